"""The rows of a list file (CSV, TSV, JSONL), read and checked before :mod:`packdata.conversion.lists` makes samples.

:func:`read_list_rows` yields ``(line number, row)``: a JSONL line must be one JSON
object of at most :data:`MAX_JSONL_LINE` characters, without a key twice; a CSV
or TSV is read strictly (a quote opened must close before a delimiter; a quoted
value that swallowed the rows after it is refused), a header naming a column
twice is refused, and a row's values past the header's columns, or columns it
gave no value, are kept under :data:`EXTRA` and :data:`SHORT` for the caller to
report.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from packdata.conversion.sources import _os_path
from packdata.errors import SourceError
from packdata.pack.manifest import first_repeated, unique_keys
from packdata.pack.urls import remote_error

__all__ = ["EXTRA", "LIST_SUFFIXES", "MAX_JSONL_LINE", "SHORT", "read_list_rows"]

LIST_SUFFIXES = {".csv": ",", ".tsv": "\t", ".jsonl": None}
_LIST_NAMES = {",": "CSV", "\t": "TSV"}
MAX_JSONL_LINE = 64 << 20
"""Characters a list's row may hold: a JSONL line, or a CSV or TSV row, its lines together (a CSV field may hold
128 Ki: csv's own limit, but a row any number of fields: 50 MB of commas took 800 MB)."""
_LONG_ROW_HINT = "Store large values in files beside the list and name them in a column"


def _open_text(list_file: Path | str, fs: Any) -> TextIO:
    """The list as UTF-8 text; a byte order mark (Excel's "CSV UTF-8") is dropped, not read into the first column."""
    if fs is None:
        return open(list_file, encoding="utf-8-sig", newline="")
    return io.TextIOWrapper(fs.open(list_file, "rb"), encoding="utf-8-sig", newline="")


def read_list_rows(
    list_file: Path | str, fs: Any = None, where: str | Path = "", path_column: str = ""
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of a CSV, TSV or JSONL file (JSONL rows must be objects), on ``fs`` if given.

    Raises:
        SourceError: a line is not a JSON object, or a CSV value swallowed rows
            (:func:`_check_merged`); for a list on ``fs``, a failed request too (resumable: the conversion is kept).
    """
    if fs is None:
        yield from _read_rows(list_file, None, where or list_file, path_column)
        return
    try:
        yield from _read_rows(list_file, fs, where, path_column)
    except (SourceError, UnicodeDecodeError, csv.Error):
        raise
    except Exception as exc:
        raise remote_error(os.fspath(where), "cannot read the list file", exc, resumable=True) from exc


_QUOTE_HINT = 'A value that starts with a double quote must end with one: "say ""hi"" twice"'
EXTRA = "\0extra"
"""A CSV row's values past its header's columns, under a name no column has (a NUL ends a CSV): a caption
with an unquoted comma ('a.jpg,a dog, running') was cut at it, the rest dropped without a word."""
SHORT = "\0short"
"""How many of a CSV row's columns it gave no value: a caption with an unquoted line break ('a.jpg,a dog' then
'running,3') was packed cut at it, its row's later columns missing, without a word."""


def _read_rows(
    list_file: Path | str, fs: Any, where: str | Path, path_column: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    delimiter = LIST_SUFFIXES[os.path.splitext(list_file)[1].lower()]
    with _open_text(list_file, fs) as f:
        if delimiter is None:
            for number, line in enumerate(iter(lambda: f.readline(MAX_JSONL_LINE + 1), ""), 1):
                if len(line) > MAX_JSONL_LINE:  # read no further: a line of gigabytes would be held whole
                    raise SourceError(
                        f"line {number} is longer than {MAX_JSONL_LINE:,} characters",
                        path=where,
                        hint=_LONG_ROW_HINT,
                    )
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, object_pairs_hook=unique_keys)
                except ValueError as exc:  # JSONDecodeError, or an integer of more than 4,300 digits
                    raise SourceError(f"line {number} is not JSON: {exc}", path=where) from exc
                except RecursionError as exc:
                    raise SourceError(
                        f"line {number} is not JSON: nested deeper than the parser goes", path=where
                    ) from exc
                if not isinstance(row, dict):
                    raise SourceError(f"line {number} is not a JSON object", path=where)
                yield number, row
        else:
            # strict: a field that opens a quote must close it before a delimiter ('"Hi" she said' lost its
            # quotes, and an unclosed one swallowed the rows after it into its value), or the list is refused
            # csv.DictReader's rows, made here (a row a third quicker): a value past the header's columns goes
            # under EXTRA, a column not given is None (counted in SHORT), blank lines are no rows
            lines = _RowLines(f, where)
            reader = csv.reader(lines, delimiter=delimiter, strict=True)
            header = next(reader, None)
            if header is None:
                return
            twice = first_repeated(header)
            if twice is not None:  # a dict keeps the last value of such a column: the first was dropped
                raise SourceError(f"the header names column {twice!r} twice", path=where, hint="Rename one of them")
            folder = os.path.dirname(list_file) if fs is None else None  # rows swallowed: looked for locally
            column = header.index(path_column) if path_column in header else -1
            columns, done = len(header), reader.line_num  # done: the lines of the rows read whole
            while True:
                start = reader.line_num + 1
                lines.start_row(start)
                try:
                    values = next(reader)
                    while not values:
                        values = next(reader)
                except StopIteration:
                    return
                except csv.Error as exc:
                    quotes = '"' in str(exc) or "end of data" in str(exc)
                    raise SourceError(
                        f"the row at line {done + 1} is not {_LIST_NAMES[delimiter]}: {exc}",
                        path=where,
                        hint=_QUOTE_HINT if quotes else None,
                    ) from exc
                cells: dict[str, Any] = dict(zip(header, values, strict=False))
                if len(values) > columns:
                    cells[EXTRA] = values[columns:]
                elif len(values) < columns:
                    cells.update(dict.fromkeys(header[len(values) :]))
                    cells[SHORT] = columns - len(values)
                if reader.line_num > start and folder is not None and column >= 0:  # a value holds line breaks
                    _check_merged(cells, start, delimiter, column, folder, where)
                done = reader.line_num
                yield done, cells


class _RowLines:
    """A CSV or TSV list's lines for ``csv.reader``, read so that no row passes :data:`MAX_JSONL_LINE` characters.

    csv limits a field, not a row: a line of commas was read whole, its
    fields all held. Each line is read with what is left of its row's
    characters, one more at most; a row longer is refused there, unread further.
    """

    def __init__(self, f: TextIO, where: str | Path) -> None:
        self.f, self.where = f, where
        self.held, self.first = 0, 1  # the row's characters so far, and its first line

    def start_row(self, line: int) -> None:
        self.held, self.first = 0, line

    def __iter__(self) -> _RowLines:
        return self

    def __next__(self) -> str:
        line = self.f.readline(MAX_JSONL_LINE + 1 - self.held)
        if not line:
            raise StopIteration
        self.held += len(line)
        if self.held > MAX_JSONL_LINE:
            raise SourceError(
                f"the row at line {self.first} is longer than {MAX_JSONL_LINE:,} characters",
                path=self.where,
                hint=_LONG_ROW_HINT,
            )
        return line


def _check_merged(row: dict[str, Any], start: int, delimiter: str, column: int, folder: str, where: str | Path) -> None:
    """Refuse a row whose quoted value swallowed the rows after it: a quote opened and never closed in its line.

    A quoted value may hold line breaks (standard CSV, a caption of several
    lines), so ``a.jpg,"a dog`` ... ``c.jpg,runs"`` reads as one row whose
    caption holds the rows between, which were lost without a word. Such a row
    is told by a line of its value that names, where a row names its file, a
    file beside the list: a ``stat`` for each such line, only in the rare
    values that span lines.

    Raises:
        SourceError: naming the row's line, the value's column and the line that reads as a row.
    """
    line = start
    for name, value in row.items():
        if not isinstance(value, str):
            continue
        lines = re.split(r"\r\n|\r|\n", value)
        for number, text in enumerate(lines[1:], line + 1):
            fields = next(csv.reader([text], delimiter=delimiter))
            path = fields[column] if len(fields) > max(column, 1) else ""
            if path and "\0" not in path and os.path.lexists(os.path.join(folder, _os_path(path))):
                raise SourceError(
                    f"the row at line {start} is not {_LIST_NAMES[delimiter]}: its value of column {name!r} runs on "
                    f"to line {line + len(lines) - 1}, and its line {number} names a file as a row "
                    f"does ({path!r}): a quote not closed swallowed the rows between",
                    path=where,
                    hint=_QUOTE_HINT,
                )
        line += len(lines) - 1
