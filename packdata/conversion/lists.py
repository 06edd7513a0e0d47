"""List files (CSV, TSV, JSONL) as multi-field sources: :func:`scan_list`, :class:`ListSource`.

One sample per row; the path column names a file (relative to the list's
folder, or absolute) stored under its extension (a list at a URL names objects
relative to its folder only, read through fsspec in the read pool; a path that
is absolute, a URL, or holds ``..`` or empty parts is a skip); a label column
gives classes (strings, numbered in sorted order like ImageFolder; or integers,
kept); every other column becomes a field of that name, stored as text when all
its values are strings and as JSON otherwise. A row's key is its path up to the
first dot of the file name (``imgs/a.jpg`` and ``./imgs/a.jpg`` -> ``imgs/a``:
``.`` and empty folder parts are dropped). Rows naming one file in other
spellings (``/data/imgs/a.jpg`` in a list in ``/data``, ``x/../imgs/a.jpg``)
are one key too: the later row is a ``"duplicate key"`` skip, though its
own key (the path as given) is packed for the earlier one alone. A file named
through a symbolic link to it is not recognised (a ``stat`` a row). Like grouped files
(:mod:`packdata.conversion.layouts`), each row is a :class:`SourceGroup`. The
rows come read and checked from :mod:`packdata.conversion.list_rows`.
"""

from __future__ import annotations

import csv
import os
import reprlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packdata.conversion.list_rows import EXTRA, LIST_SUFFIXES, SHORT, read_list_rows
from packdata.conversion.sources import (
    FREE_CLASSES,
    RemoteFile,
    Skip,
    SourceGroup,
    _check_required,
    _is_utf8,
    _os_path,
)
from packdata.errors import ConfigError, SourceError
from packdata.pack.fields import LABEL_FIELD, FieldError, check_field_name, codec_of, encode_value
from packdata.pack.keyset import KeySet
from packdata.pack.urls import display_url, is_url, open_url, remote_error

__all__ = ["ListSource", "scan_list"]


def _integer(value: Any) -> int | None:
    """A label given as a JSON integer or as ASCII digits (at most 10: labels are int32), else None.

    ``str.isdigit`` also takes ``'²'``, which ``int`` refuses, and ``int`` refuses
    more than 4,300 digits: both were raw ValueErrors.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        if text.isascii() and text.isdigit() and len(text) <= 10:
            return int(text)
    return None


@dataclass
class ListSource:
    """A CSV, TSV or JSONL list of samples (see the module docstring)."""

    root: Path | str  # the list's folder (its URL, without credentials, for a list at a URL)
    list_file: Path | str  # a path on fs for a list at a URL
    path_column: str
    label_column: str | None
    classes: list[str]
    codecs: dict[str, str]
    kind: str = "fields"
    _labels: dict[str, int] = field(default_factory=dict, repr=False)
    fs: Any = None  # the fsspec filesystem of a list at a URL
    base: str = ""  # the list's folder on fs
    require: tuple[str, ...] = ()  # fields every row must give (its file's, or a column's)

    def walk(self, spill: Path | None = None) -> Iterator[SourceGroup | Skip]:
        """Yield one group per row, in file order; a row without a usable path or label is a skip.

        ``spill``: a folder where the keys seen spill past a memory budget (:class:`~packdata.pack.keyset.KeySet`).
        """
        # key -> the row that first gave it: a dict of str (and paths) was 250 bytes a row
        named = (self.path_column, self.label_column)  # the columns that are no field
        root = os.path.join(self.root, "")  # the list's folder and a separator: a relative path joins it
        with KeySet(spill=spill) as keys:
            roots = _roots(self.root) if self.fs is None else ()
            for number, row in read_list_rows(self.list_file, self.fs, self._where, self.path_column):
                where = f"row {number}"
                if EXTRA in row:
                    extra = len(row[EXTRA])
                    detail = f"{extra} value{'s' * (extra != 1)} past the header's columns (a delimiter not in quotes?)"
                    yield Skip(where, "bad row", detail)
                    continue
                if SHORT in row:
                    short = row[SHORT]
                    detail = (
                        f"{short} value{'s' * (short != 1)} short of the header's columns (a line break not in quotes?)"
                    )
                    yield Skip(where, "bad row", detail)
                    continue
                raw_path = row.get(self.path_column)
                if not isinstance(raw_path, str) or not raw_path:
                    yield Skip(where, "no path", f"column {self.path_column!r} is empty or missing")
                    continue
                # JSON spells a lone surrogate ("\ud800"): no file name in UTF-8 holds one (ASCII holds none)
                if not (raw_path.isascii() or _is_utf8(raw_path)):
                    yield Skip(where, "bad path", f"the path {raw_path!r} is not valid UTF-8 (a lone surrogate)")
                    continue
                folder, _, base = raw_path.replace(os.sep, "/").rpartition("/")
                stem, _, extension = base.partition(".")
                if not stem:  # the key would end at the file name's first dot: "" for .env.txt, PackWriter refuses that
                    detail = f"the file name of {raw_path!r} starts with a dot (or is empty): it gives no key"
                    yield Skip(where, "no key", f"{detail} (a key is the path up to the first dot of the file name)")
                    continue
                folder = _plain_folder(folder)  # ./a.jpg and a.jpg name one file: one key, not that file packed twice
                key = f"{folder}/{stem}" if folder else stem  # WebDataset's key: the path up to the first dot
                same = key  # the key as the list's folder names it: /root/a.jpg and x/../a.jpg name a.jpg, key a
                if self.fs is None and (raw_path.startswith("/") or ".." in raw_path) and "\0" not in raw_path:
                    same = _key_from(self.root, raw_path, roots)
                first = keys.add(same, number)
                if first is not None:
                    said = f" (as {same!r}, from the list's folder)" if same != key else ""
                    detail = f"{where} ({raw_path}) has the key of row {first}{said}: {_KEY_RULE}"
                    yield Skip(key, "duplicate key", detail)
                    continue
                label = -1
                if self.label_column is not None:
                    value = row.get(self.label_column)
                    label = self._label(value)
                    if label < 0:
                        detail = f"label {value!r} is not a class or a non-negative integer below {len(self.classes)}"
                        if value is None or (isinstance(value, str) and not value.strip()):
                            detail = f"no label: column {self.label_column!r} is empty or missing"
                        yield Skip(key, "bad label", f"{where}: {detail}")
                        continue
                if "\0" in raw_path:  # no file is named so; os.stat raised a bare ValueError in a reader thread
                    yield Skip(key, "bad path", f"{where}: the path holds a NUL byte, which no file name can")
                    continue
                name = extension.lower() or "bytes"
                if row.get(name) is not None and name not in named:
                    detail = f"{where}: the file ({raw_path}) and column {name!r} both give field {name!r}"
                    yield Skip(key, "duplicate field", detail)
                    continue
                missing = [n for n in self.require if n != name and (n in named or row.get(n) is None)]
                if missing:
                    detail = f"{where}: no {', '.join(missing)} field (required: {', '.join(self.require)})"
                    yield Skip(key, "missing field", detail)
                    continue
                path: str | RemoteFile
                if self.fs is not None:
                    parts = raw_path.split("/")
                    if raw_path.startswith("/") or "://" in raw_path or any(p in ("", ".", "..") for p in parts):
                        yield Skip(key, "bad path", f"{where}: a list at a URL names objects relative to its folder")
                        continue
                    path = RemoteFile(self.fs, f"{self.base}/{raw_path}", f"{self.root}/{raw_path}")
                else:
                    path = _os_path(raw_path)  # the list's UTF-8 names, not the locale's (ASCII: a traceback)
                    path = path if path.startswith(os.sep) else root + path  # os.path.join(self.root, path)
                values: list[tuple[str, bytes]] = []
                problem = None
                for column, value in row.items():
                    if value is None or column in named:
                        continue
                    if column not in self.codecs:  # a KeyError stopped the conversion with a traceback
                        detail = f"{where}: column {column!r} was not in the list when it was read first"
                        problem = Skip(key, "list changed", f"{detail}: it changed while converting (convert again)")
                        break
                    try:
                        values.append((column, encode_value(column, value, self.codecs[column])))
                    except FieldError as exc:
                        problem = Skip(key, "bad value", f"{where}: {exc}")
                        break
                yield problem if problem is not None else SourceGroup(key, label, ((name, path),), tuple(values))

    @property
    def cheap_to_count(self) -> bool:
        """A list at a URL is not read twice (for the progress bar's total): one download of it is enough."""
        return self.fs is None

    def count_walk(self) -> Iterator[int]:
        """One item per entry :meth:`walk` yields (a group or a skip a row), without its work: the bar's count.

        The walk itself remembers every key (:class:`~packdata.pack.keyset.KeySet`): a second one, in the
        counting thread, would hold as much again.
        """
        for number, _ in read_list_rows(self.list_file, self.fs, self._where, self.path_column):
            yield number

    @property
    def _where(self) -> str | Path:
        """The list file in messages: its path, or its URL without credentials."""
        return f"{self.root}/{os.path.basename(self.list_file)}" if self.fs is not None else self.list_file

    def _label(self, value: Any) -> int:
        if isinstance(value, str) and value.strip() in self._labels:
            return self._labels[value.strip()]
        number = _integer(value)
        if number is None or (isinstance(value, str) and self._labels):
            return -1
        return number if 0 <= number < len(self.classes) else -1


_KEY_RULE = "a key is the path up to the first dot of the file name, without '.' or empty folder parts"


def _roots(root: Path | str) -> tuple[str, ...]:
    """The list's folder as an absolute path, and its real path where another: the prefixes of paths inside it."""
    plain, real = os.path.abspath(root), os.path.realpath(root)
    return tuple(path.rstrip(os.sep) + os.sep for path in dict.fromkeys((plain, real)))


def _key_from(root: Path | str, raw_path: str, roots: tuple[str, ...]) -> str:
    """The key a list path has as a path from the list's folder ``root`` (``roots``: :func:`_roots`).

    An absolute path inside the folder is read from there (``/data/a.jpg`` in
    a list in ``/data``: ``a``); one with ``..`` parts has its folder
    resolved (links followed: through a link, ``x/..`` need not be the list's
    folder), its only ``stat``; any other path, as the list gives it.
    Neither is a file named through a symbolic link to it found (that would
    take a ``stat`` a row).
    """
    path = os.path.join(root, _os_path(raw_path))
    folder, base = os.path.split(path)
    if ".." in raw_path.replace(os.sep, "/").split("/"):
        folder = os.path.realpath(folder)
    full = os.path.join(os.path.normpath(folder), base)
    for prefix in roots:
        if full.startswith(prefix):
            full = full[len(prefix) :]
            break
    folder, _, base = full.replace(os.sep, "/").rpartition("/")
    folder = _plain_folder(folder)
    stem = base.partition(".")[0]
    return f"{folder}/{stem}" if folder else stem


def _plain_folder(folder: str) -> str:
    """A list path's folder without ``.`` and empty parts (``./imgs``, ``imgs/./``, ``imgs//``: ``imgs``).

    ``..`` parts stay: through a link, ``x/../a.jpg`` may be another file than ``a.jpg``.
    """
    if "." not in folder and "//" not in folder and not folder.endswith("/"):  # no such part: most folders
        return folder
    plain = "/".join(part for part in folder.split("/") if part not in ("", "."))
    return f"/{plain}" if folder.startswith("/") else plain


def scan_list(
    list_file: str | os.PathLike,
    *,
    path_column: str = "path",
    label_column: str | None = None,
    storage_options: dict[str, Any] | None = None,
    require: tuple[str, ...] = (),
) -> ListSource:
    """Read a list file once: check its columns, number string labels like ImageFolder, choose each column's codec.

    ``list_file`` may be a URL (with ``storage_options`` for fsspec): its rows
    then name objects relative to the list's folder there. ``require``: fields
    every row must give (its file's, named by its extension, or a column's).

    Raises:
        SourceError: the file is missing, unreadable, empty, or lacks the path column (or the label column),
            or its label column holds both integers and class names.
        ConfigError: a column, or a name in ``require``, cannot name a field.
    """
    _check_required(require)
    fs, base, where = None, "", os.fspath(list_file)
    suffix = os.path.splitext(where)[1].lower()
    if suffix not in LIST_SUFFIXES:
        raise ConfigError(f"a list file ends in .csv, .tsv or .jsonl, not {suffix!r}", path=list_file)
    if is_url(where):
        fs, path = open_url(where, storage_options)
        where = display_url(where)
        try:
            exists = fs.isfile(path)
        except Exception as exc:
            raise remote_error(where, "cannot look the list file up", exc) from exc
        if not exists:
            raise SourceError("no such list file", path=where, hint="Check the URL")
        list_file, base = path, path.rsplit("/", 1)[0]
    else:
        list_file = Path(list_file)
        if not list_file.is_file():
            raise SourceError("no such list file", path=list_file, hint="Check the path")
    columns: dict[str, bool] = {}  # column -> every value is a string
    string_labels: set[str] = set()
    int_labels = False
    top_free = -1  # the largest integer label below FREE_CLASSES
    past_free: set[int] = set()  # integer labels from FREE_CLASSES up: each costs its row, and lists rarely have any
    rows = 0
    label_seen = False
    try:
        for _, row in read_list_rows(list_file, fs, where, path_column):
            rows += 1
            if path_column not in row:
                raise SourceError(
                    f"a row has no {path_column!r} column (columns: {sorted(row)})",
                    path=where,
                    hint="Name the column with path_column=NAME",
                )
            for column, value in row.items():
                if column in (path_column, label_column, EXTRA, SHORT):
                    continue
                columns[column] = columns.get(column, True) and (isinstance(value, str) or value is None)
            if label_column is not None:
                label_seen = label_seen or label_column in row
                label = row.get(label_column)
                if isinstance(label, int) and not isinstance(label, bool):
                    int_labels = True
                elif isinstance(label, str) and label.strip() and _is_utf8(label):
                    string_labels.add(label.strip())  # 'cat ' is cat; a blank cell, or a lone surrogate, is no class
                number = _integer(label)
                if number is not None and number < FREE_CLASSES:
                    top_free = max(top_free, number)
                elif number is not None:
                    past_free.add(number)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise SourceError(f"cannot read the list file: {exc}", path=where) from exc
    if rows == 0:
        raise SourceError("the list file has no rows", path=where)
    if label_column is not None and not label_seen:
        raise SourceError(
            f"no row has a {label_column!r} column (columns: {sorted(columns.keys() | {path_column})})",
            path=where,
            hint="Name the column with label_column=NAME",
        )
    codecs = {}
    for column, all_strings in columns.items():
        try:
            check_field_name(column)
        except FieldError as exc:
            raise ConfigError(f"column {column!r}: {exc}", path=where) from exc
        if column == LABEL_FIELD:
            raise ConfigError("column 'cls' is the label: pass it with label_column='cls'", path=where)
        named = codec_of(column)
        codecs[column] = named if named != "bytes" else ("txt" if all_strings else "json")
    if fs is not None:
        root: Path | str = where.rsplit("/", 1)[0]
    else:
        root = Path(list_file).parent
    source = ListSource(root, list_file, path_column, label_column, [], codecs, fs=fs, base=base, require=require)
    numbers = sorted(s for s in string_labels if _integer(s) is not None)
    if numbers and not int_labels and len(numbers) < len(string_labels):  # names sorted as text: '10' < '2'
        name = reprlib.repr(min(string_labels.difference(numbers)))
        raise SourceError(
            f"column {label_column!r} holds both integer labels ({numbers[0]!r}) and class names ({name}): "
            "as names, every integer would become another class number",
            path=where,
            hint="Give every row a class name, or every row an integer label",
        )
    if string_labels and not (int_labels or numbers):
        source.classes = sorted(string_labels)
        source._labels = {c: i for i, c in enumerate(source.classes)}
    else:  # integer labels stay; their classes are their numbers, as many as the list may claim
        top_label = max((n for n in past_free if n < rows), default=top_free)
        source.classes = [str(i) for i in range(top_label + 1)]
    return source
