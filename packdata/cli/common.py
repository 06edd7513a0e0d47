"""What every command shares: library errors said in flags as one line, escaped output, sizes with units."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import select
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from packdata.errors import PackdataError
from packdata.units import SIZE_RULE

__all__ = ["as_flags"]


def as_flags(message: str, flags: dict[str, str]) -> str:
    """Say a library message in flags: ``overwrite=True`` -> ``--overwrite``, ``to=DIR`` -> ``--to DIR``.

    A message that opens with a keyword's name (``shards should be ...``) opens
    with its flag (``--shards should be ...``). ``flags`` maps keyword arguments
    to the command's options (``{"to": "--to"}``); other words are left as they are.
    Keywords listed with commas that all have a flag are said as one command line
    (``num_workers=2, batch_size=64`` -> ``--workers 2 --batch-size 64``), to be pasted.

    A boolean flag with an off form is given as click declares it (``{"pin_memory":
    "--pin-memory/--no-pin-memory"}``): ``pin_memory=False`` -> ``--no-pin-memory``. A flag
    without one (``--overwrite``) has no way to say ``False``: ``overwrite=False`` is left out
    of a command line and said ``no --overwrite`` elsewhere; ``True`` is the flag alone. ``x=None``
    (an option left unset: ``max_side=None``) is said as such a ``False``, whatever the flag.
    """

    def said(match: re.Match[str], *, pasted: bool) -> tuple[str, str]:
        """The flag for one ``keyword=value`` (empty: left out of a command line) and the sentence's punctuation."""
        option = flags[match.group(1)]
        value, end = match.group(2), ""
        if len(value) > 1 and value[-1] in ".:" and not value.startswith("'"):  # the sentence's, not the value's
            value, end = value[:-1], value[-1]
        on, _, off = option.partition("/")
        if value == "True":
            return on, end
        if value in ("False", "None"):  # None: the option left unset (no command takes 'None'), never its off form
            return (off if value == "False" else "") or ("" if pasted else f"no {on}"), end
        return f"{on} {value.strip(chr(39))}", end

    def flag(match: re.Match[str]) -> str:
        return "".join(said(match, pasted=False)) if match.group(1) in flags else match.group(0)

    def subject(match: re.Match[str]) -> str:
        return flags.get(match.group(1), match.group(1)).partition("/")[0] + match.group(2)

    def keywords(match: re.Match[str]) -> str:
        found = list(_KEYWORD.finditer(match.group(0)))
        if len(found) == 1 or not all(k.group(1) in flags for k in found):
            return ", ".join(flag(k) for k in found)
        line = [said(k, pasted=True) for k in found]  # a command line: a False without an off form is left out
        return " ".join(text for text, _ in line if text) + line[-1][1]

    return _SUBJECT.sub(subject, _KEYWORDS.sub(keywords, message), count=1)


CLOSED_STDOUT_STATUS = 128 + signal.SIGPIPE
"""The exit status when the reader of stdout went away (``packdata ls PACK | head -1``): 141, as git's and seq's."""


class _Main(click.Group):
    """The ``packdata`` group: a command whose stdout reader closed the pipe exits quietly, as Unix tools do.

    click exits 1 then, which scripts read as packdata's own ``Error:`` status
    with no line to say it; git, seq and yes die of SIGPIPE (status 141). A
    broken pipe that is not stdout's (a socket, a child) is left to click.
    """

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            if not _reader_gone(sys.stdout):
                raise
            devnull = os.open(os.devnull, os.O_WRONLY)  # what is still buffered goes there at exit, unsaid
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            ctx.exit(CLOSED_STDOUT_STATUS)


def _reader_gone(stream: Any) -> bool:
    """Whether ``stream`` is a pipe whose reading end is closed (poll reports POLLERR for it)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), 0)  # POLLERR and POLLHUP are always reported
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (CliRunner's buffer), or closed
        return False


_KEYWORD = re.compile(r"(?<![\w.-])([a-z][a-z0-9_]*)=('[^']*'|[^\s,;)]+)")
_KEYWORDS = re.compile(rf"{_KEYWORD.pattern}(?:, {_KEYWORD.pattern})*")
_SUBJECT = re.compile(r"\A([a-z][a-z0-9_]*)( should )")


def _count(n: int, noun: str) -> str:
    """``1 shard``, ``2 shards``, ``1,200 files``."""
    return f"{n:,} {noun}{'s' * (n != 1)}"


class _FiniteFloat(click.FloatRange):
    """A ``FloatRange`` that refuses ``nan`` and ``inf`` (click takes both: a sleep or a budget never ends)."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):  # said before the range: 'inf' is not a number too large
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)


def _friendly(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn packdata's own errors into one line, in flags rather than keyword arguments, and exit 1.

    A newline, tab or control character in the message (a path, a key) is escaped.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except PackdataError as exc:
            raise click.ClickException(_said(exc)) from exc

    return wrapper


def _said(exc: PackdataError) -> str:
    """The one line the running command says for ``exc``: in its flags, a control character escaped."""
    return _in_flags(str(exc))


def _in_flags(message: str, *, also: dict[str, str] | None = None) -> str:
    """A library ``message`` as the running command says it: in its flags, a control character escaped.

    ``also`` maps more keywords to its flags (bench's ``num_workers``, the DataLoader's word, is ``--workers``).
    """
    command = click.get_current_context().command
    flags: dict[str, str] = dict(also or {})
    for param in command.params:
        if isinstance(param, click.Option):
            said = "/".join([param.opts[0], *param.secondary_opts[:1]])  # --pin-memory/--no-pin-memory
            flags[param.opts[0].lstrip("-").replace("-", "_")] = said
            flags.setdefault(param.name or "", said)  # the keyword it passes on: repeats= is --repeat
    message = as_flags(message, flags)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


_ZERO_OK = {"reserve"}  # sizes where 0 means something (keep nothing free)


_SIZE_HELP = f"Sizes need a unit: {SIZE_RULE}."


_C1 = re.compile("[\x7f-\x9f]")


def _json_text(value: Any, *, indent: int | None = None) -> str:
    """``value`` as JSON for a terminal: other scripts kept as they are, DEL and the C1 controls escaped.

    JSON escapes only U+0000-U+001F; U+007F-U+009F (some terminals obey U+009B as an escape sequence)
    from a stranger's pack or source are written as ``\\u`` escapes too, which read back the same.
    """
    return _C1.sub(lambda m: f"\\u{ord(m[0]):04x}", json.dumps(value, indent=indent, ensure_ascii=False))


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    """Comma-separated integers: at least 0 for ``--workers``, at least 1 for batch sizes and prefetch factors."""
    if value is None:
        return None
    least = 0 if param.name == "workers" else 1
    try:
        values = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"should be comma-separated integers, but got {value!r}") from None
    if min(values) < least:
        raise click.BadParameter(f"should be comma-separated integers >= {least}, but got {value!r}")
    return values


def _teach_metavars(group: click.Group) -> None:
    """Name what an option's value is in --help: ``--shard-size SIZE``, ``--seconds SECONDS``, ``--workers N,N,...``.

    click names the type instead (``TEXT``, ``FINITE FLOAT RANGE``), which teaches nothing about what to write.
    An option that names its own metavar keeps it.
    """
    by_callback = {_size: "SIZE", _json_object: "JSON", _int_list: "N,N,..."}
    for command_name, command in group.commands.items():
        for param in command.params:
            if not isinstance(param, click.Option) or param.metavar is not None:
                continue
            name = param.name or ""
            if param.callback in by_callback:
                param.metavar = by_callback[param.callback]
            elif isinstance(param.type, _FiniteFloat):
                param.metavar = "MS" if name.endswith("_ms") else "SECONDS" if name in ("seconds", "interval") else "N"
            elif (command_name, name) in _TEXT_METAVARS or name in _TEXT_METAVARS:
                param.metavar = _TEXT_METAVARS.get((command_name, name)) or _TEXT_METAVARS[name]
            elif isinstance(param.type, click.IntRange):
                param.metavar = "N"


_TEXT_METAVARS: dict[str | tuple[str, str], str] = {
    "require": "FIELD,FIELD,...",
    "path_column": "COLUMN",
    "label_column": "COLUMN",
    "address": "ADDRESS",
    "shards": "SHARD,SHARD,...",
    "field_name": "FIELD",
    "device": "DEVICE",
    ("stage", "name"): "NAME",
    ("monitor", "name"): "WORD",
}
"""What a free-text option's value is, by its keyword (or its command and keyword), where click says TEXT."""


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    from packdata.units import parse_size

    try:
        return parse_size(value, zero_ok=param.name in _ZERO_OK)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _json_object(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any] | None:
    """``--storage-options``: a JSON object, parsed here so a typo is a usage error, not a traceback.

    The error never shows the value: it holds credentials (``{"key": ..., "secret": ...}``).
    """
    if value is None:
        return None
    try:
        options = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(
            f"should be a JSON object such as '{{\"anon\": true}}', but got invalid JSON: {exc.msg} "
            f"at character {exc.pos + 1} of {len(value)}"
        ) from exc
    except RecursionError as exc:  # '[[[[...' deeper than Python's stack: json.loads raises this, not a decode error
        raise click.BadParameter(
            f"should be a JSON object such as '{{\"anon\": true}}', but got JSON nested too deeply to read "
            f"({len(value)} characters)"
        ) from exc
    if not isinstance(options, dict):
        raise click.BadParameter(
            f"should be a JSON object such as '{{\"anon\": true}}', but got a JSON {type(options).__name__}"
        )
    return options


def _output_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file option the command writes at its end: it must be writable now, not after minutes of work."""
    if value is None or value == "-":
        return value
    folder = os.path.dirname(value) or "."
    if not os.path.isdir(folder):
        raise click.BadParameter(f"cannot write {value!r}: its folder {folder} does not exist or is not a folder")
    try:  # root passes every permission check: only creating the file tells (/proc, a read-only mount)
        if os.path.lexists(value):
            open(value, "ab").close()  # appends nothing: the file stays as it is until the end
        else:
            os.close(os.open(value, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            os.unlink(value)
    except OSError as exc:
        raise click.BadParameter(f"cannot write {value!r}: {exc.strerror or exc}") from None
    return value


def _write_failed(path: str, exc: OSError) -> click.ClickException:
    """The one line for an output file that could not be written in the end."""
    return click.ClickException(f"{path}: cannot write the file ({exc.strerror or exc})")


def _mb(n: int) -> str:
    from packdata.units import format_size

    return format_size(n)
