"""Tests of packdata.units: the one size parser and formatter."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from packdata.cli import main
from packdata.units import exact_size, format_size, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1000B", 1000),
        ("30G", 30 * GiB),
        ("30g", 30 * GiB),
        ("30GB", 30 * 10**9),
        ("30gb", 30 * 10**9),
        ("30GiB", 30 * GiB),
        ("30gib", 30 * GiB),
        ("512M", 512 * MiB),
        ("64MB", 64 * 10**6),
        ("64MiB", 64 * MiB),
        ("4K", 4 * KiB),
        ("4kB", 4000),
        ("4KiB", 4 * KiB),
        ("1.5T", int(1.5 * TiB)),
        ("2TB", 2 * 10**12),
        ("1TiB", TiB),
        (" 16 G ", 16 * GiB),
        ("100B", 100),
        ("0.5K", 512),
        (".5G", GiB // 2),
        ("1.0B", 1),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["3 apples", "", "G", "-1G", "1.5B", "30 GBs", "1e9", "1,000", "nan", "30X"])
def test_parse_size_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid size .*: expected a number with a unit such as 64MB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["256", "30", "0"])
def test_a_size_without_a_unit_is_refused(text: str) -> None:
    """``--shard-size 256`` once made 300 one-file shards and ``--tmpfs 30`` a 4 KiB mount."""
    with pytest.raises(ValueError, match=rf"size '{text}' has no unit: write {text}B for bytes, or {text}MB"):
        parse_size(text)


def test_zero_is_refused_unless_it_can_be_meant() -> None:
    """A tmpfs of size=0 is unlimited to the kernel; only a reserve of 0B means something."""
    with pytest.raises(ValueError, match="is zero"):
        parse_size("0G")
    assert parse_size("0B", zero_ok=True) == 0


def test_a_size_under_one_byte_is_refused_as_zero() -> None:
    """``--tmpfs 0.0001K`` became size=0 and was refused as the API's 'size=0', a name the CLI user never typed;
    ``--budget 0.0001K`` staged nothing."""
    with pytest.raises(ValueError, match=r"^size '0.0001K' is zero once rounded down to whole bytes, which cannot"):
        parse_size("0.0001K")
    assert parse_size("0.0001K", zero_ok=True) == 0 and parse_size("0.001K") == 1
    result = CliRunner().invoke(main, ["stage", "--tmpfs", "0.0001K", "--mount", "/nonexistent/area"])
    assert result.exit_code == 2 and "Invalid value for '--tmpfs': size '0.0001K' is zero once rounded" in result.output


def test_a_size_no_disk_or_memory_has_is_refused() -> None:
    """``stage --tmpfs 99999999999999999999999T --force`` mounted what the kernel made of it: an 8 EiB tmpfs."""
    for text in ("99999999999999999999999T", f"{1 << 63}B", "8388608T"):
        with pytest.raises(ValueError, match=rf"size '{text}' is 8 EiB \(2\*\*63 bytes\) or more"):
            parse_size(text)
    assert parse_size("8388607T") == (1 << 63) - (1 << 40)


def test_parse_size_message_quotes_the_input() -> None:
    with pytest.raises(ValueError, match=r"^invalid size '3 apples': expected a number with a unit"):
        parse_size("3 apples")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (int(1.5 * GiB), "1.5 GiB"),
        (30 * GiB, "30.0 GiB"),
        (MiB - 1, "1.0 MiB"),
        (2 * TiB, "2.0 TiB"),
        (3 << 60, "3.0 EiB"),
        (-2 * GiB, "-2.0 GiB"),
    ],
)
def test_format_size(n: int, expected: str) -> None:
    assert format_size(n) == expected


def test_parse_format_round_trip() -> None:
    for n in (KiB, 7 * MiB, 3 * GiB, 5 * TiB):
        value, unit = format_size(n).split()
        assert parse_size(value + unit) == n


def test_exact_size_is_one_word_parse_size_reads_back_exactly() -> None:
    """For a size put in a command line to paste: format_size's '27.9 GiB' is two words, and rounded."""
    import random

    assert [exact_size(n) for n in (1 << 30, 30 * 10**9, 4097, 1536 << 20, 10**12, 3 << 40)] == [
        "1G",
        "30GB",
        "4097B",
        "1536M",
        "1TB",
        "3T",
    ]
    rng = random.Random(0)
    for n in [1, 1023, 1024, (1 << 63) - 1] + [
        rng.randrange(1, 1 << 63) >> rng.randrange(63) or 1 for _ in range(2000)
    ]:
        word = exact_size(n)
        assert " " not in word and parse_size(word) == n, (n, word)
