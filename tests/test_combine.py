"""Growing and combining packs: convert --append and merge, on real packs and a real concurrent reader."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import image_bytes

import packdata
from packdata.cli import main as cli
from packdata.errors import ConfigError
from packdata.formats.lmdb import DATA_FILE
from packdata.pack.manifest import read_manifest


def _folder(root: Path, classes: dict[str, list[str]]) -> Path:
    for name, files in classes.items():
        (root / name).mkdir(parents=True)
        for i, file in enumerate(files):
            (root / name / file).write_bytes(image_bytes(hash((name, file)) % 1000 + i))
    return root


def _samples(pack: Path) -> list[tuple[str, bytes, str]]:
    """(key, stored bytes, class name) of every sample, in pack order."""
    lmdb_pack = read_manifest(pack).format == "lmdb"
    ds = (packdata.LMDBDataset if lmdb_pack else packdata.TFRecordIndexedDataset)(pack, decode="bytes")
    return [(ds.keys[i], data, ds.classes[label]) for i, (data, label) in enumerate(ds)]


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_merge_unites_classes_by_name_and_keeps_every_sample(tmp_path: Path, fmt: str) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"], "dog": ["3.jpg"]})
    b = _folder(tmp_path / "b", {"ant": ["4.jpg"], "dog": ["5.jpg", "6.jpg"]})
    packdata.convert(a, tmp_path / f"a.{fmt}", progress=False)
    packdata.convert(b, tmp_path / f"b.{fmt}", progress=False, shard_samples=2)
    result = packdata.merge_packs([tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"], tmp_path / f"ab.{fmt}")
    assert (result.samples, result.shards) == (6, 3)
    # b's ant (0 -> 2) is renumbered: its shard is written anew; b's shard of dogs only (1 -> 1) is linked
    assert (result.rewritten, result.linked) == (1, 2)
    merged = packdata.LMDBDataset if fmt == "lmdb" else packdata.TFRecordIndexedDataset
    ds = merged(tmp_path / f"ab.{fmt}", decode="bytes")
    assert ds.classes == ["cat", "dog", "ant"]
    assert _samples(tmp_path / f"ab.{fmt}") == _samples(tmp_path / f"a.{fmt}") + _samples(tmp_path / f"b.{fmt}")
    assert packdata.verify_pack(tmp_path / f"ab.{fmt}", progress=False).records == 6


def test_merge_links_shards_refuses_or_renames_duplicate_keys(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"]})
    packdata.convert(a, tmp_path / "a.lmdb", progress=False)
    packdata.convert(a, tmp_path / "a2.lmdb", progress=False)
    with pytest.raises(ConfigError, match=r"key 'cat/1\.jpg' .* already in an earlier pack"):
        packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "a2.lmdb"], tmp_path / "x.lmdb")
    assert not (tmp_path / "x.lmdb").exists() and not (tmp_path / ".x.lmdb.partial").exists()
    result = packdata.merge_packs(
        [tmp_path / "a.lmdb", tmp_path / "a2.lmdb"], tmp_path / "x.lmdb", on_duplicate="rename"
    )
    assert (result.linked, result.rewritten, result.renamed_keys) == (1, 1, 2)
    data = tmp_path / "x.lmdb" / "shard-00000.lmdb" / DATA_FILE
    assert os.stat(data).st_ino == os.stat(tmp_path / "a.lmdb" / "shard-00000.lmdb" / DATA_FILE).st_ino
    assert list(packdata.LMDBDataset(tmp_path / "x.lmdb").keys) == [
        "cat/1.jpg",
        "cat/2.jpg",
        "cat/1.jpg~1",
        "cat/2.jpg~1",
    ]
    assert packdata.verify_pack(tmp_path / "x.lmdb", progress=False).records == 4


def test_merge_of_multi_field_packs_remaps_fields(tmp_path: Path) -> None:
    with packdata.PackWriter(tmp_path / "a.lmdb") as w:
        w.write({"__key__": "a1", "txt": "hello", "json": {"n": 1}})
    with packdata.PackWriter(tmp_path / "b.lmdb") as w:
        w.write({"__key__": "b1", "json": {"n": 2}, "npy": b"\x93NUMPY-not-checked-here"})
        w.write({"__key__": "b2", "txt": "bye", "cls": 1})
    packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "b.lmdb"], tmp_path / "ab.lmdb")
    ds = packdata.LMDBDataset(tmp_path / "ab.lmdb", decode="bytes")
    assert ds.pack.manifest.fields == ["json", "txt", "npy"]
    assert [ds.pack.index.sample_fields(i) for i in range(3)] == [
        {"json": 8, "txt": 5},
        {"json": 8, "npy": 23},
        {"txt": 3},
    ]
    assert ds[2] == {"__key__": "b2", "txt": b"bye", "cls": 1}
    assert packdata.verify_pack(tmp_path / "ab.lmdb", progress=False).records == 3


def test_merge_refuses_mixed_formats(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    packdata.convert(a, tmp_path / "a.lmdb", progress=False)
    packdata.convert(a, tmp_path / "a.tfrecord", progress=False)
    with pytest.raises(ConfigError, match="one format and kind"):
        packdata.merge_packs([tmp_path / "a.lmdb", tmp_path / "a.tfrecord"], tmp_path / "x.lmdb")


_READER = """
import sys, time
import packdata
ds = packdata.LMDBDataset(sys.argv[1], decode="bytes")
first = ds[0][0]  # opened and reading before the append
print("ready", flush=True)
sys.stdin.readline()  # the append happens now
print(len(ds), sorted(ds.keys[i] for i in range(len(ds))), all(ds[i][0] for i in range(len(ds))), flush=True)
"""


def test_append_keeps_old_shards_and_a_reader_opened_before(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg", "2.jpg"], "dog": ["3.jpg"]})
    b = _folder(tmp_path / "b", {"ant": ["4.jpg"], "dog": ["5.jpg"]})
    pack = tmp_path / "p.lmdb"
    packdata.convert(a, pack, progress=False)
    before = _samples(pack)
    old_shard = pack / "shard-00000.lmdb" / DATA_FILE
    stat = os.stat(old_shard)
    reader = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_READER), str(pack)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert reader.stdout is not None and reader.stdin is not None
    assert reader.stdout.readline().strip() == "ready"
    in_process = packdata.LMDBDataset(pack, decode="bytes")
    result = packdata.convert(b, pack, append=True, progress=False)
    reader.stdin.write("go\n")
    reader.stdin.flush()
    out, _ = reader.communicate(timeout=60)
    assert reader.returncode == 0
    assert out.strip() == "3 ['cat/1.jpg', 'cat/2.jpg', 'dog/3.jpg'] True"
    assert [in_process[i][0] for i in range(3)] == [data for _, data, _ in before]
    assert result.packed == 2
    after = _samples(pack)
    assert after[:3] == before
    assert sorted(after[3:]) == [("ant/4.jpg", (b / "ant" / "4.jpg").read_bytes(), "ant"),
                                 ("dog/5.jpg", (b / "dog" / "5.jpg").read_bytes(), "dog")]  # fmt: skip
    assert packdata.LMDBDataset(pack).classes == ["cat", "dog", "ant"]
    now = os.stat(old_shard)
    assert (now.st_ino, now.st_mtime_ns, now.st_size) == (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    assert packdata.verify_pack(pack, progress=False).records == 5


def test_append_refuses_repeated_keys_and_cleans_leftovers(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    pack = tmp_path / "p.lmdb"
    packdata.convert(a, pack, progress=False)
    with pytest.raises(ConfigError, match=r"repeat key 'cat/1\.jpg'"):
        packdata.convert(a, pack, append=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["a", "p.lmdb"]
    (pack / "shard-a7-00000-of-00001.lmdb").mkdir()  # what an append killed before its manifest leaves
    (pack / "index-a7").mkdir()
    c = _folder(tmp_path / "c", {"cat": ["9.jpg"]})
    packdata.convert(c, pack, append=True, progress=False)
    names = sorted(os.listdir(pack))
    assert "shard-a7-00000-of-00001.lmdb" not in names and "index-a7" not in names
    assert packdata.verify_pack(pack, progress=False).records == 2
    runner = CliRunner()
    done = runner.invoke(cli, ["convert", str(c), str(pack), "--append", "-q"])
    assert done.exit_code == 1 and "repeat key 'cat/9.jpg'" in done.output


def test_cli_merge(tmp_path: Path) -> None:
    a = _folder(tmp_path / "a", {"cat": ["1.jpg"]})
    b = _folder(tmp_path / "b", {"cat": ["2.jpg"]})
    packdata.convert(a, tmp_path / "a.lmdb", progress=False)
    packdata.convert(b, tmp_path / "b.lmdb", progress=False)
    runner = CliRunner()
    done = runner.invoke(cli, ["merge", str(tmp_path / "a.lmdb"), str(tmp_path / "b.lmdb"), "-o", str(tmp_path / "m")])
    assert done.exit_code == 0, done.output
    assert "2 samples in 2 shards (2 linked, 0 copied, 0 rewritten)" in done.output
