"""KeySet: the keys a conversion has seen, in about 40 bytes a key, answering exactly as a dict would."""

from __future__ import annotations

import hashlib
import io
import random
import tarfile
import threading
import tracemalloc
from pathlib import Path

import fsspec
import pytest

import packdata
from packdata.conversion import lists
from packdata.conversion.lists import scan_list
from packdata.conversion.local import _count_walk
from packdata.errors import ConfigError
from packdata.pack import keyset
from packdata.pack.keyset import KeySet
from packdata.progress import progress


def _keys(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    pool = [f"train/c{rng.randrange(50)}/img_{rng.randrange(3000):05d}" for _ in range(count)]
    return [*pool, "a", "ä/ö", "name\udcff", "x" * 4000]  # non-ASCII, a name os.listdir gave from bytes, a long one


def _check_against_dict(keys: KeySet, added: list[str], absent: list[str]) -> None:
    truth: dict[str, int] = {}
    for value, key in enumerate(added):
        assert keys.add(key, value) == truth.get(key), key
        truth.setdefault(key, value)
        assert len(keys) == len(truth)
    assert all(key in keys for key in truth)
    assert not any(key in keys for key in absent if key not in truth)
    assert all(keys.add(key, -1) == value for key, value in truth.items())  # the first value stays


@pytest.mark.parametrize("min_recent", [1, 3, 1 << 16])
def test_a_key_set_answers_as_a_dict_across_merges(min_recent: int) -> None:
    """add returns None for a new key, the first value for a repeat, in the recent dict and the merged arrays."""
    keys = _keys(5000, seed=min_recent)
    _check_against_dict(KeySet(min_recent), keys, _keys(2000, seed=99))


def test_keys_whose_digests_share_their_first_eight_bytes_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arrays are sorted on 8 bytes: rows sharing them are each compared on the other 8, never taken as one."""

    def weak(key: str) -> bytes:  # 16 possible first halves: most keys share one with many others
        full = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        return bytes(7) + full[:1] + full[8:]

    monkeypatch.setattr(keyset, "_digest", weak)
    _check_against_dict(KeySet(4), _keys(3000, seed=7), _keys(1000, seed=8))


def test_a_list_walk_holds_well_under_a_hundred_bytes_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A list's walk remembers every key to refuse repeats: a dict of keys and paths held about 250 bytes a row,
    25 GB for 100 M rows. It now holds a KeySet: the walk's peak, all rows walked, stays under 100 bytes a row
    (its recent-keys dict made as small, against the rows, as it is for a list of millions)."""
    monkeypatch.setattr(keyset, "_MIN_RECENT", 1024)
    rows = 60_000
    listing = tmp_path / "l.csv"
    listing.write_text("path\n" + "".join(f"train/c{i % 10}/img_{i:08d}.jpg\n" for i in range(rows)), encoding="utf-8")
    source = scan_list(listing)
    tracemalloc.start()
    try:
        walked = sum(1 for _ in source.walk())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert walked == rows
    assert peak < 100 * rows, f"{peak / rows:.0f} bytes a row"


def test_a_packwriter_names_the_sample_that_first_gave_a_repeated_key(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        for n in range(3):
            writer.write({"__key__": f"k{n}", "txt": "x"})
        with pytest.raises(ConfigError, match=r"key 'k1' was written before \(sample 1\)"):
            writer.write({"__key__": "k1", "txt": "y"})
        writer.write({"__key__": "k3", "txt": "z"})
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "w.lmdb")] == ["k0", "k1", "k2", "k3"]


def test_a_tar_key_repeated_in_a_later_shard_names_the_shard_that_gave_it_first(tmp_path: Path) -> None:
    for shard, keys in (("a-0.tar", ["k0", "k1"]), ("a-1.tar", ["k2", "k0"])):
        with tarfile.open(tmp_path / shard, "w") as tar:
            for key in keys:
                info = tarfile.TarInfo(f"{key}.txt")
                info.size = len(key)
                tar.addfile(info, io.BytesIO(key.encode()))
    result = packdata.convert(f"{tmp_path}/a-{{0..1}}.tar", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 3 and result.skipped == {"duplicate key": 1}
    detail = result.skip_examples[0]["detail"]
    assert detail == f"an earlier sample in {tmp_path}/a-0.tar has this key ({tmp_path}/a-1.tar)"


def test_the_progress_bars_count_of_a_list_reads_rows_and_remembers_no_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bar's total came from a second walk in a thread, which built a second KeySet as large as the walk's
    (and parsed every label and path again). It now counts rows: as many as the walk's entries, skips included."""
    made: list[int] = []

    class CountedKeySet(KeySet):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(lists, "KeySet", CountedKeySet)
    listing = tmp_path / "l.csv"
    rows = ["a.txt,cat", "b.txt,dog", "a.txt,dog", ",cat", "c.txt,", 'd.txt,"x,y"', "e.txt,cat"]
    listing.write_text("path,label\n" + "\n".join(rows) + "\n", encoding="utf-8")
    source = scan_list(listing, label_column="label")
    bar = progress(desc="packing", unit=" files", disable=True)
    _count_walk(source, bar, threading.Event())
    assert made == []
    assert bar.total == len(list(source.walk())) == len(rows)
    assert made == [1]
    fsspec.filesystem("memory").pipe("/keyset-lists/l.csv", listing.read_bytes())
    assert source.cheap_to_count and not scan_list("memory://keyset-lists/l.csv").cheap_to_count  # downloaded once
