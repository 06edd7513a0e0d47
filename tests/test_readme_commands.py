"""README's and --help's command lines name commands, flags and choices that exist, as a user pastes them."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from packdata.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"

_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_COMMAND = re.compile(r"(?:^|[;&|(]\s*|sudo\s+)packdata\s+([a-z][\w-]*)(.*?)(?=&&|\|\||[|;)]|$)")


def _options(command: click.Command) -> dict[str, click.Option]:
    """Every spelling of the command's options (``--pin-memory``, ``--no-pin-memory``, ``-q``, ``--help``)."""
    found: dict[str, click.Option] = {}
    for param in command.get_params(click.Context(command)):
        if isinstance(param, click.Option):
            found.update(dict.fromkeys([*param.opts, *param.secondary_opts], param))
    return found


def _problems(line: str) -> list[str]:
    """What in one shell line's ``packdata SUB ...`` calls names no command, flag or choice of it."""
    problems = []
    code, _, comment = line.partition(" #")
    for match in _COMMAND.finditer(code):
        name, rest = match.group(1), match.group(2)
        command = main.commands.get(name)
        if command is None:
            problems.append(f"no command {name!r}: {line.strip()}")
            continue
        options = _options(command)
        tokens = rest.replace("[", " ").replace("]", " ").split()
        for i, token in enumerate(tokens):
            flag = token.partition("=")[0]
            if not _FLAG.fullmatch(flag):
                continue
            option = options.get(flag)
            if option is None:
                problems.append(f"{name} has no option {flag}: {line.strip()}")
                continue
            value = token.partition("=")[2] or (tokens[i + 1] if i + 1 < len(tokens) else "")
            choices = option.type.choices if isinstance(option.type, click.Choice) else None
            if choices and not option.is_flag and value and value not in choices:
                problems.append(f"{name} {flag} takes {'|'.join(choices)}, not {value!r}: {line.strip()}")
        # A comment may name more of the same command's long options ("# also: --storage-options '{...}'").
        problems += [
            f"{name} has no option {flag} (in a comment): {line.strip()}"
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", comment)
            if flag not in options
        ]
    return problems


def _readme_blocks() -> list[str]:
    return re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", README.read_text(), re.S)


def test_readme_has_packdata_command_lines_to_check() -> None:
    """The check below reads README's bash blocks: if their fence changed, it would check nothing."""
    lines = [line for block in _readme_blocks() for line in block.splitlines() if _COMMAND.search(line)]
    assert len(lines) >= 20, lines
    assert {m.group(1) for line in lines for m in _COMMAND.finditer(line)} >= {"convert", "stage", "bench", "ls"}


def test_every_packdata_line_in_readmes_bash_blocks_names_a_command_and_its_flags() -> None:
    problems = [p for block in _readme_blocks() for line in block.splitlines() for p in _problems(line)]
    assert problems == []


def test_every_packdata_call_and_flag_in_readmes_prose_exists() -> None:
    """Inline code: `packdata stage --status`, `convert --resume`, a bare `--on-error fail` (some command's)."""
    prose = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    every: dict[str, list[click.Option]] = {}
    for command in main.commands.values():
        for flag, option in _options(command).items():
            every.setdefault(flag, []).append(option)
    problems = []
    for span in spans:
        if span.startswith("packdata "):
            problems += _problems(span)
        elif span.split(" ", 1)[0] in main.commands and "--" in span:  # `convert --append`
            problems += _problems(f"packdata {span}")
        elif span.startswith("--"):
            flag, _, value = span.partition(" ")
            value = value.split(" ", 1)[0]
            if flag not in every:
                problems.append(f"no command has the option {flag}: `{span}`")
            elif value and not value.startswith("-") and not value.isupper():  # `--batches N`: a placeholder
                options = [o for o in every[flag] if isinstance(o.type, click.Choice)]
                if options and not any(value in o.type.choices for o in options):  # type: ignore[attr-defined]
                    problems.append(f"no command's {flag} takes {value!r}: `{span}`")
    assert problems == []


@pytest.mark.parametrize("name", sorted(main.commands))
def test_every_example_in_a_commands_help_names_its_flags(name: str) -> None:
    """The Examples: lines of each --help are what a user copies first."""
    command = main.commands[name]
    examples = [line for line in (command.help or "").splitlines() if "packdata " in line]
    assert examples, f"packdata {name} --help shows no example line"
    problems = [p for line in examples for p in _problems(line.strip())]
    assert problems == []


def test_the_check_finds_a_flag_a_command_does_not_have() -> None:
    """The checker itself: a misspelt flag, a missing command and a choice that is not one are each found."""
    assert _problems("packdata convert ./a b.lmdb --overwrit") == [
        "convert has no option --overwrit: packdata convert ./a b.lmdb --overwrit"
    ]
    assert _problems("sudo packdata stagee --tmpfs 30G") == ["no command 'stagee': sudo packdata stagee --tmpfs 30G"]
    assert _problems("packdata convert a b --on-error=ignore") == [
        "convert --on-error takes skip|fail, not 'ignore': packdata convert a b --on-error=ignore"
    ]
    assert _problems("packdata ls x.lmdb --limit 5 | head  # --json for scripts") == []
    assert _problems("packdata export a ./b && diff -r ./a ./b") == []
