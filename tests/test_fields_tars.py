"""Multi-field samples from WebDataset tars: member names, damaged, gzipped and sparse tars, size limits."""

from __future__ import annotations

import filecmp
import gzip
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import image_bytes, tar_with_a_hard_link
from fields_helpers import _convert_in_an_ascii_locale

import packdata
from packdata.cli import main as cli
from packdata.conversion.destination import partial_path
from packdata.errors import ConfigError
from packdata.formats.contents import export_pack


def _wds_shards(folder: Path, count: int = 7, per_shard: int = 3) -> list[dict]:
    """Tars written by the webdataset package itself; returns the samples as written."""
    wds = pytest.importorskip("webdataset")
    folder.mkdir()
    samples = [
        {"__key__": f"s/{i:04d}", "jpg": image_bytes(i), "txt": f"caption {i}", "json": {"i": i}, "cls": i % 3}
        for i in range(count)
    ]
    with wds.ShardWriter(str(folder / "data-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)
    return samples


def test_webdataset_tars_convert_field_equal(tmp_path: Path) -> None:
    samples = _wds_shards(tmp_path / "tars")
    pattern = str(tmp_path / "tars" / "data-{000000..000002}.tar")
    result = packdata.convert(pattern, tmp_path / "out.lmdb", progress=False)
    assert result.packed == 7 and not result.skipped
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", decode={"jpg": "bytes"})
    assert ds.classes == ["0", "1", "2"]
    for i, expected in enumerate(samples):
        assert ds[i] == {**expected, "txt": expected["txt"]}
    again = packdata.convert(str(tmp_path / "tars" / "data-*.tar"), tmp_path / "glob.lmdb", progress=False)
    assert again.packed == 7


def test_a_tar_of_a_folder_made_with_tar_c_dot_keys_samples_without_its_dot_prefix(tmp_path: Path) -> None:
    """``tar -cf x.tar -C DIR .`` names members ./KEY.FIELD: the key is KEY (a '.' part would stop export)."""
    files = tmp_path / "files"
    (files / "sub").mkdir(parents=True)
    for key in ("000", "sub/001"):
        (files / f"{key}.jpg").write_bytes(image_bytes(int(key[-1])))
        (files / f"{key}.txt").write_text(f"caption {key}", encoding="utf-8")
    subprocess.run(["tar", "-cf", str(tmp_path / "x.tar"), "-C", str(files), "."], check=True)
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and not result.skipped
    assert packdata.LMDBDataset(tmp_path / "out.lmdb").keys[:] == ["000", "sub/001"]
    export_pack(tmp_path / "out.lmdb", tmp_path / "back")
    assert not filecmp.dircmp(files, tmp_path / "back").diff_files
    assert sorted(p.relative_to(tmp_path / "back").as_posix() for p in (tmp_path / "back").rglob("*.*")) == [
        "000.jpg",
        "000.txt",
        "sub/001.jpg",
        "sub/001.txt",
    ]


def test_tar_member_names_become_relative_keys_and_one_leading_out_is_a_bad_key(tmp_path: Path) -> None:
    """Members named '../x.txt', '/abs/y.txt', 'a/./w.txt', 'a//v.txt', 'a/../u.txt' were packed under those
    keys verbatim, where a key is a relative path (export refused each). They are now keyed as tar extracts them
    (leading '/', '.', empty parts and an inner '..' dropped); one whose '..' leads out is a 'bad key' skip."""
    names = ["../x.txt", "/abs/y.txt", "./z.txt", "a/./w.txt", "a//v.txt", "a/../u.txt", "a/b/../../../t.txt"]
    (tmp_path / "d.tar").write_bytes(_tar_of([(name, name.encode()) for name in names]))
    result = packdata.convert(str(tmp_path / "d.tar"), tmp_path / "out.lmdb", progress=False)
    assert (result.packed, result.skipped) == (5, {"bad key": 2})
    detail = "its '..' leads out of the tar's top folder: a key is a relative path inside it (tar refuses it too)"
    assert result.skip_examples == [
        {"key": f"d.tar:{name}", "reason": "bad key", "detail": detail} for name in ("../x.txt", "a/b/../../../t.txt")
    ]
    packed = {s["__key__"]: s["txt"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")}
    assert packed == {"abs/y": "/abs/y.txt", "z": "./z.txt", "a/w": "a/./w.txt", "a/v": "a//v.txt", "u": "a/../u.txt"}
    assert export_pack(tmp_path / "out.lmdb", tmp_path / "back").refused == []


def test_tars_are_read_once_even_with_a_progress_bar(tmp_path: Path, monkeypatch) -> None:
    from packdata.conversion.tars import TarSource

    _wds_shards(tmp_path / "tars")
    reads: list[str] = []
    real = TarSource._read

    def counting(self, shard, keys):
        reads.append(shard)
        return real(self, shard, keys)

    monkeypatch.setattr(TarSource, "_read", counting)
    result = packdata.convert(str(tmp_path / "tars" / "data-*.tar"), tmp_path / "out.lmdb", progress=True)
    assert result.packed == 7 and sorted(reads) == sorted(set(reads)) and len(reads) == 3  # no counting walk


_LOW_MEMORY_CLI = """
import resource, sys
from packdata.cli import main
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)))  # 1 GiB more address space
main(sys.argv[1:])
"""


def test_a_local_tar_that_fails_not_as_a_damaged_tar_is_named_by_its_path_with_a_hint_for_a_file(
    tmp_path: Path,
) -> None:
    """It said '://data.tar: cannot read the tar ... Check the URL, the endpoint and the credentials': not a URL."""
    tar = tmp_path / "data.tar"
    size = 1_500_000_000  # one member past the child's memory: reading it raises MemoryError
    info = tarfile.TarInfo("s000.bin")
    info.size = size
    header = info.tobuf(format=tarfile.USTAR_FORMAT)
    with open(tar, "wb") as f:  # sparse: no disk used, read back as zeros
        f.write(header)
        f.truncate(len(header) + size + (-size % 512) + 1024)
    dst = tmp_path / "out.lmdb"
    args = [sys.executable, "-c", _LOW_MEMORY_CLI, "convert", str(tar), str(dst), "-q"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (
        f"Error: {tar}: cannot read the tar (MemoryError). "
        "Free memory (or convert on a machine with more), then rerun with --resume"
    )
    assert partial_path(dst).is_dir() and not dst.exists()  # kept, to resume


def test_gzipped_damaged_and_duplicate_tars(tmp_path: Path) -> None:
    import gzip

    _wds_shards(tmp_path / "tars", count=4, per_shard=2)
    first = tmp_path / "tars" / "data-000000.tar"
    (tmp_path / "tars" / "data-000000.tar.gz").write_bytes(gzip.compress(first.read_bytes()))
    copy = tmp_path / "tars" / "data-000002.tar"  # the same keys again: duplicates
    shutil.copy(first, copy)
    cut = tmp_path / "tars" / "data-000003.tar"
    with tarfile.open(cut, "w") as tar:
        link = tarfile.TarInfo("x/0.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
        for name, data in (("x/1.txt", b"one"), ("x/2.txt", b"two" * 4000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cut.write_bytes(cut.read_bytes()[:3500])  # cut inside x/2's data
    result = packdata.convert(
        str(tmp_path / "tars" / "data-{000000..000003}.tar"), tmp_path / "out.lmdb", progress=False
    )
    assert result.packed == 5  # 4 good samples + x/1 before the cut; x/2 is cut and dropped
    assert result.skipped == {"duplicate key": 2, "corrupt tar": 1, "not a regular file": 1}
    assert packdata.LMDBDataset(tmp_path / "out.lmdb")[4] == {"__key__": "x/1", "txt": "one"}
    gz = packdata.convert(str(tmp_path / "tars" / "data-000000.tar.gz"), tmp_path / "gz.lmdb", progress=False)
    assert gz.packed == 2
    with pytest.raises(packdata.SourceError, match="no such tar shard"):
        packdata.convert(str(tmp_path / "tars" / "data-{000000..000009}.tar"), tmp_path / "x.lmdb", progress=False)


def test_a_tar_pattern_naming_too_many_shards_in_all_is_one_line(tmp_path: Path) -> None:
    """Each range was bounded, not their product: two ranges of a million named a trillion, a MemoryError.

    (1001 x 1001 here: past the bound, yet cheap to expand on the previous commit, which then looked each up.)
    """
    pattern = str(tmp_path / "data-{0..1000}-{0..1000}.tar")  # 1,002,001 names
    result = CliRunner().invoke(cli, ["convert", pattern, str(tmp_path / "x.lmdb"), "-q"])
    assert (result.exit_code, result.output) == (1, f"Error: {pattern}: the pattern names more than 1000000 shards\n")
    assert os.listdir(tmp_path) == []


def _tar_of(members: list[tuple[str | bytes, bytes]]) -> bytes:

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(os.fsdecode(name) if isinstance(name, bytes) else name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("damage", ["cut at a member's end", "a damaged header", "a zeroed header"])
def test_a_tar_damaged_between_members_is_named_not_ended_in_silence(tmp_path: Path, damage: str) -> None:
    """tarfile's stream mode ended the archive without a word at such a header: the samples after it were lost."""
    raw = bytearray(_tar_of([(f"s{i}.txt", b"sample %d " % i * 50) for i in range(4)]))
    header = 2 * 1024  # the third member's header (each member: a header block and one data block)
    if damage == "cut at a member's end":
        raw = raw[:header]
    elif damage == "a damaged header":
        raw[header + 3] ^= 0xFF
    else:
        raw[header : header + 512] = bytes(512)
    (tmp_path / "data.tar").write_bytes(bytes(raw))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.skipped == {"corrupt tar": 1}
    assert result.packed == 1  # s0; s1 (the sample being read) is dropped, never packed partly
    assert result.skip_examples[0]["key"] == "data.tar:s1"


def test_a_gzipped_tar_is_checked_whole_before_any_sample_is_packed(tmp_path: Path) -> None:
    """gzip's CRC is at its end, and tarfile's stream mode never read it: a flipped byte was packed as data."""
    import gzip

    first = os.urandom(3000)  # incompressible: stored, so the flip lands in the member's bytes
    packed = bytearray(gzip.compress(_tar_of([("a.bin", first), ("b.bin", os.urandom(3000))]), compresslevel=0))
    packed[packed.index(first[:64]) + 100] ^= 0xFF
    (tmp_path / "flip.tar.gz").write_bytes(bytes(packed))
    (tmp_path / "cut.tar.gz").write_bytes(gzip.compress(_tar_of([("c.bin", b"c" * 3000)]))[:-12])
    for name in ("flip.tar.gz", "cut.tar.gz"):
        with pytest.raises(packdata.SourceError, match=r"skipped: 1 corrupt tar"):
            packdata.convert(str(tmp_path / name), tmp_path / f"{name}.lmdb", progress=False)
    whole = tmp_path / "whole.tar.gz"
    whole.write_bytes(gzip.compress(_tar_of([("a.bin", first)])))
    assert (
        packdata.LMDBDataset(packdata.convert(str(whole), tmp_path / "w.lmdb", progress=False).pack)[0]["bin"] == first
    )


def test_a_fifo_matched_by_a_shard_glob_is_skipped_as_corrupt_not_waited_on(tmp_path: Path) -> None:
    (tmp_path / "data-0.tar").write_bytes(_tar_of([("a.txt", b"x")]))
    os.mkfifo(tmp_path / "data-1.tar")  # an open() for reading would block until a writer came
    result = packdata.convert(str(tmp_path / "data-*.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"corrupt tar": 1}
    assert "a FIFO" in result.skip_examples[0]["detail"]


def test_a_tar_member_named_in_non_utf8_bytes_is_skipped_by_name(tmp_path: Path) -> None:
    """It once reached the sample index, which cannot hold it: a traceback, and no resume could pass it."""
    (tmp_path / "data.tar").write_bytes(_tar_of([(b"caf\xe9.txt", b"x"), ("ok.txt", b"y")]))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"name not UTF-8": 1}


def test_a_tar_member_named_in_non_utf8_bytes_past_its_key_skips_its_sample(tmp_path: Path) -> None:
    """c.cls\\xe9 was skipped by name alone and sample c packed without its label (-1). Now c is skipped whole."""
    members: list[tuple[str | bytes, bytes]] = [("c.json", b"[3]"), (b"c.cls\xe9", b"3"), ("d.json", b"[4]")]
    (tmp_path / "data.tar").write_bytes(_tar_of(members))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"name not UTF-8": 1}
    said = "member 'c.cls\\xe9' is named in bytes not UTF-8: the sample is skipped whole"
    assert [(e["key"], e["detail"]) for e in result.skip_examples] == [("data.tar:c", said)]
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["d"]


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_tar_member_whose_key_no_record_holds_is_skipped(tmp_path: Path, fmt: str) -> None:
    """A pax name of 70,000 bytes; an LMDB record holds 65,535 (a uint16 length): it once crashed the writer."""

    key = "k" * 70_000
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in (f"{key}.txt", "ok.txt"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    (tmp_path / "data.tar").write_bytes(out.getvalue())
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / f"out.{fmt}", progress=False)
    assert result.packed == 1 and result.skipped == {"key too long": 1}
    assert result.skip_examples[0] == {
        "key": f"{key[:100]}...",
        "reason": "key too long",
        "detail": "70000 bytes in UTF-8, at most 65535 fit",
    }


def test_pack_writer_refuses_a_key_no_record_holds_when_it_is_written(tmp_path: Path) -> None:
    """Such keys were taken, then failed the whole pack at close with a raw RecordError or UnicodeEncodeError."""
    with packdata.PackWriter(tmp_path / "w.lmdb") as writer:
        with pytest.raises(ConfigError, match=r"is longer than 65535 bytes in UTF-8"):
            writer.write({"__key__": "k" * 65_536, "txt": "x"})
        with pytest.raises(ConfigError, match=r"key 'caf\\udce9' is not valid UTF-8"):
            writer.write({"__key__": "caf\udce9", "txt": "x"})
        writer.write({"__key__": "k" * 65_535, "txt": "the longest key fits"})
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "w.lmdb")] == ["k" * 65_535]


def test_a_tar_sample_with_a_member_over_the_limit_is_skipped_whole(tmp_path: Path, monkeypatch) -> None:
    """Never packed in part: the sample's other members go with it (as a folder's or a list's would)."""
    from packdata.conversion import tars

    monkeypatch.setattr(tars, "MAX_SAMPLE_BYTES", 100)
    (tmp_path / "x.tar").write_bytes(
        _tar_of([("s1.txt", b"one"), ("s1.bin", b"x" * 200), ("s1.json", b"{}"), ("s2.txt", b"two")])
    )
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert result.skip_examples[0]["key"] == "x.tar:s1"
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["s2"]


def test_a_tar_sample_whose_members_together_pass_the_limit_is_skipped_before_the_one_that_passes_it(
    tmp_path: Path, monkeypatch
) -> None:
    """Each member fits, not all of them: a .tar.gz of 1.5 GB members of one key was read whole, then refused."""
    from packdata.conversion import tars

    monkeypatch.setattr(tars, "MAX_SAMPLE_BYTES", 100)
    (tmp_path / "x.tar").write_bytes(
        _tar_of([("s1.a", b"x" * 60), ("s1.b", b"y" * 60), ("s1.c", b"z"), ("s2.txt", b"two")])
    )
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert result.skip_examples[0]["key"] == "x.tar:s1"
    assert result.skip_examples[0]["detail"].startswith("field 'b': 120 bytes; a sample holds at most")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["s2"]


def test_a_sparse_tar_member_is_skipped_not_read_as_its_claimed_size_of_zeros(tmp_path: Path) -> None:
    """A 10 KB tar of two pax sparse members claiming 1 GiB each (no data): tarfile reads the holes as zeros."""
    import resource

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("s1.a", "s1.b"):
            info = tarfile.TarInfo(f"GNUSparseFile.0/{name}")
            info.pax_headers = {
                "GNU.sparse.major": "1",
                "GNU.sparse.minor": "0",
                "GNU.sparse.name": name,
                "GNU.sparse.realsize": str(1 << 30),
            }
            sparse_map = b"1\n0\n0\n".ljust(512, b"\0")  # one chunk of 0 bytes at 0: the rest is a hole
            info.size = len(sparse_map)
            tar.addfile(info, io.BytesIO(sparse_map))
        info = tarfile.TarInfo("s2.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"two"))
    (tmp_path / "x.tar").write_bytes(out.getvalue())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = packdata.convert(str(tmp_path / "x.tar"), tmp_path / "out.lmdb", progress=False)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024  # KiB: never read
    assert result.packed == 1 and result.skipped == {"not a regular file": 1}  # sample s1, skipped whole
    assert [e["key"] for e in result.skip_examples] == ["x.tar:s1"]
    said = f"member 's1.a' is a sparse member ({1 << 30} bytes, 0 stored): the sample is skipped whole"
    assert result.skip_examples[0]["detail"] == said
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["s2"]


def test_a_tar_whose_pax_sparse_map_is_not_numbers_is_a_corrupt_tar_not_a_failed_request(tmp_path: Path) -> None:
    """tarfile's int() of GNU.sparse.map raised a bare ValueError: the run stopped, 'Check the URL ... resume'."""

    for name, pax in (("a.tar", {}), ("b.tar", {"GNU.sparse.map": "x,y", "GNU.sparse.size": "3"})):
        with tarfile.open(tmp_path / name, "w", format=tarfile.PAX_FORMAT) as tar:
            for member in (f"{name[0]}1.txt", f"{name[0]}2.txt"):
                info = tarfile.TarInfo(member)
                info.size = 3
                info.pax_headers = pax if member.endswith("2.txt") else {}
                tar.addfile(info, io.BytesIO(b"abc"))
    result = packdata.convert(str(tmp_path / "{a,b}.tar"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and result.skipped == {"corrupt tar": 1}
    assert result.skip_examples[0]["key"] == "b.tar:b1"
    assert "damaged member header at byte 3072: invalid literal for int()" in result.skip_examples[0]["detail"]
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a1", "a2"]


def test_tar_member_names_are_read_as_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """tarfile decoded a GNU tar's names in the locale's encoding: under LC_ALL=C with PYTHONUTF8=0 (ASCII) the
    member café.txt was a 'name not UTF-8' skip, a sample lost on that machine alone (Latin-1 gave another key)."""
    (tmp_path / "data.tar").write_bytes(_tar_of([("café.txt", b"x"), ("ok.txt", b"y")]))
    _convert_in_an_ascii_locale(tmp_path / "data.tar", tmp_path / "c.lmdb")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "c.lmdb")] == ["café", "ok"]


def test_a_tar_sample_with_two_members_of_one_field_is_skipped_whole(tmp_path: Path) -> None:
    """a.bin then a.BIN (both field bin): the sample was packed with the first and the second reported as a
    member skipped, though nothing tells which is the sample's. It is skipped whole, as a grouped folder's is."""
    members = [("a.bin", b"first"), ("a.BIN", b"second"), ("a.txt", b"cap a"), ("b.bin", b"only"), ("b.txt", b"b")]
    (tmp_path / "data.tar").write_bytes(_tar_of(members))
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert (result.found, result.packed, result.skipped) == (2, 1, {"duplicate field": 1})
    detail = "two members give field 'bin', the second 'a.BIN'"
    assert result.skip_examples == [{"key": "data.tar:a", "reason": "duplicate field", "detail": detail}]
    assert list(packdata.LMDBDataset(tmp_path / "out.lmdb", decode="bytes")) == [
        {"__key__": "b", "bin": b"only", "txt": b"b"}
    ]


def _tar_in_order(path: Path, members: list[tuple[str, bytes | None]]) -> None:
    """A tar of ``members`` in this order (as an unsorted ``tar -c`` of a folder may write them); None: a FIFO."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.FIFOTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _apart(key: str, member: str, done: str) -> str:
    return (
        f"the tar's members of sample {key!r} are not next to each other: {member!r} comes after other samples' "
        f"members, and the members before them were {done}; these later members are skipped, never added to it "
        "(sort the tar: tar --sort=name)"
    )


def test_a_sample_whose_tar_members_are_apart_is_never_packed_in_part_under_a_report_of_it_skipped_whole(
    tmp_path: Path,
) -> None:
    """A sample's members apart in a tar (an unsorted tar -c: a.bin, b.bin, a.json) were read as two samples of
    one key: with a FIFO among them, c.json was packed as sample c while the report said c was 'skipped whole'
    (c.json before the FIFO), or c's FIFO skipped c 'whole' and its later c.json was packed as sample c. Now the
    first run of a key's members is the sample (packed whole, or skipped with its reason) and every later run is a
    'duplicate key' skip that says what was done with the sample: the pack and the report agree."""
    packed = "packed as the sample"
    skipped = "skipped as the sample (reported)"
    fifo = "member 'c.cls' is a link or device in the tar: the sample is skipped whole"
    cases = {
        "fifo first": (
            [("c.cls", None), ("d.json", b"[4]"), ("c.json", b"[3]")],
            [{"__key__": "d", "json": b"[4]"}],
            [("c", "not a regular file", fifo), ("c", "duplicate key", _apart("c", "c.json", skipped))],
        ),
        "split": (
            [("a.bin", b"A"), ("b.bin", b"B"), ("a.json", b"[1]"), ("b.json", b"[2]")],
            [{"__key__": "a", "bin": b"A"}, {"__key__": "b", "bin": b"B"}],
            [
                ("a", "duplicate key", _apart("a", "a.json", packed)),
                ("b", "duplicate key", _apart("b", "b.json", packed)),
            ],
        ),
        "fifo later": (
            [("c.json", b"[3]"), ("d.json", b"[4]"), ("c.cls", None), ("c.txt", b"t")],
            [{"__key__": "c", "json": b"[3]"}, {"__key__": "d", "json": b"[4]"}],
            [("c", "duplicate key", _apart("c", "c.cls", packed))],
        ),
    }
    for case, (members, samples, skips) in cases.items():
        _tar_in_order(tmp_path / f"{case}.tar", members)
        out = tmp_path / f"{case}.lmdb"
        result = packdata.convert(str(tmp_path / f"{case}.tar"), out, progress=False)
        assert list(packdata.LMDBDataset(out, decode="bytes")) == samples, case
        examples = [(s["key"], s["reason"], s["detail"]) for s in result.skip_examples]
        assert examples == [(f"{case}.tar:{key}", reason, detail) for key, reason, detail in skips], case
        assert (result.packed, sum(result.skipped.values())) == (len(samples), len(skips)), case


def test_a_key_skipped_in_one_tar_is_never_packed_from_a_later_tar(tmp_path: Path) -> None:
    """Across tars only a packed key was remembered: a sample skipped in the first tar (a FIFO member, two members
    of one field, a tar cut in its data) was then packed from the second tar under that key, while the report said
    the key was skipped. Now the first tar's sample of a key is the sample, packed or skipped: a later tar's is a
    'duplicate key' skip naming both tars and saying what was done with the first, as for one tar's members apart."""
    first, second = tmp_path / "t-0.tar", tmp_path / "t-1.tar"
    big = b"D" * 3000
    _tar_in_order(
        first,
        [("a.bin", None), ("a.json", b"[0]"), ("b.bin", b"B0"), ("c.bin", b"C0"), ("c.BIN", b"C1"), ("d.bin", big)],
    )
    with tarfile.open(first) as tar:
        cut = tar.getmember("d.bin").offset_data + 1000  # inside d's data: d is the sample the tar ends in
    first.write_bytes(first.read_bytes()[:cut])
    _tar_in_order(second, [(f"{key}.bin", key.encode()) for key in "abcde"])
    out = tmp_path / "out.lmdb"
    result = packdata.convert(str(tmp_path / "t-{0..1}.tar"), out, progress=False)
    assert list(packdata.LMDBDataset(out, decode="bytes")) == [
        {"__key__": "b", "bin": b"B0"},
        {"__key__": "e", "bin": b"e"},
    ]
    earlier = f"an earlier sample in {first} has this key ({second})"
    skipped = f"{earlier}; that one was skipped (reported): this one is never packed in its place"
    cut_detail = f"member 'd.bin' claims 3000 bytes, past the tar's end (byte {cut}); the samples before this one"
    cut_detail += " in the tar are kept"
    assert [(s["key"], s["reason"], s["detail"]) for s in result.skip_examples] == [
        (
            "t-0.tar:a",
            "not a regular file",
            "member 'a.bin' is a link or device in the tar: the sample is skipped whole",
        ),
        ("t-0.tar:c", "duplicate field", "two members give field 'bin', the second 'c.BIN'"),
        ("t-0.tar:d", "corrupt tar", cut_detail),
        ("a", "duplicate key", skipped),
        ("b", "duplicate key", earlier),
        ("c", "duplicate key", skipped),
        ("d", "duplicate key", skipped),
    ]
    assert (result.packed, result.skipped) == (
        2,
        {"not a regular file": 1, "duplicate field": 1, "corrupt tar": 1, "duplicate key": 4},
    )


def test_a_hard_link_in_a_tar_is_read_from_the_member_it_names(tmp_path: Path) -> None:
    """tar and tarfile.add store a file's second name as a hard link member: b.txt was skipped as 'not a regular
    file' and sample b packed without its caption. It is now read from a.txt's bytes in the tar."""
    tar_with_a_hard_link(tmp_path / "src", tmp_path / "data.tar")
    with tarfile.open(tmp_path / "data.tar") as tar:
        assert tar.getmember("b.txt").islnk()
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "out.lmdb", progress=False)
    assert (result.packed, result.skipped) == (2, {})
    assert list(packdata.LMDBDataset(tmp_path / "out.lmdb")) == [
        {"__key__": "a", "json": [1], "txt": "one caption"},
        {"__key__": "b", "json": [2], "txt": "one caption"},
    ]


def test_a_tar_member_left_unread_skips_its_sample_not_packed_without_it(tmp_path: Path) -> None:
    """A link the reader cannot follow (in a gzipped tar, or a symbolic one) was skipped and its sample packed
    without that field: b without its caption, or without its cls label. The sample is skipped whole now."""
    import gzip

    tar_with_a_hard_link(tmp_path / "src", tmp_path / "data.tar")
    (tmp_path / "data.tar.gz").write_bytes(gzip.compress((tmp_path / "data.tar").read_bytes()))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in (("c.json", b"[3]"), ("d.json", b"[4]")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            if name == "c.json":
                link = tarfile.TarInfo("c.cls")
                link.type, link.linkname = tarfile.SYMTYPE, "labels/3.cls"
                tar.addfile(link)
    (tmp_path / "sym.tar").write_bytes(out.getvalue())
    for tar_name, skipped_key, kept in (("data.tar.gz", "b", "a"), ("sym.tar", "c", "d")):
        result = packdata.convert(str(tmp_path / tar_name), tmp_path / f"{tar_name}.lmdb", progress=False)
        assert (result.packed, result.skipped) == (1, {"not a regular file": 1})
        assert result.skip_examples[0]["key"] == f"{tar_name}:{skipped_key}"
        assert result.skip_examples[0]["detail"].endswith("is a link or device in the tar: the sample is skipped whole")
        assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / f"{tar_name}.lmdb")] == [kept]


def _member(name: str, data: bytes, fmt: int = tarfile.PAX_FORMAT, pax: dict[str, str] | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.pax_headers = pax or {}
    return info.tobuf(format=fmt) + data.ljust(-(-len(data) // 512) * 512, b"\0")


@pytest.mark.parametrize("header", ["pax", "global pax", "gnu long name"])
def test_a_tar_header_claiming_more_than_a_header_holds_is_a_corrupt_tar_not_read_into_memory(
    tmp_path: Path, header: str
) -> None:
    """17 MiB of pax records or long name, gzipped to KiBs: tarfile read them whole, thrice over (400 MB: 1.2 GB)."""
    big = 17 << 20
    at, what = 2048, "a GNU long name" if header == "gnu long name" else "pax records"  # after a1 and a2
    if header == "pax":
        damaged = _member("b.txt", b"b", pax={"comment": "x" * big})
    elif header == "gnu long name":
        damaged = _member("b" * big + ".txt", b"b", fmt=tarfile.GNU_FORMAT)
    else:  # each global header under the limit, both together past it
        damaged = tarfile.TarInfo.create_pax_global_header({"comment": "x" * (big // 2)})
        at, what = (
            2048 + len(damaged),
            f"pax records (with the {len('comment') + big // 2:,} bytes of global ones before)",
        )
        damaged += tarfile.TarInfo.create_pax_global_header({"packdata.other": "y" * (big // 2)})
        damaged += _member("b.txt", b"b")
    plain = _member("a1.txt", b"1") + _member("a2.txt", b"2") + damaged + _member("c.txt", b"c") + bytes(1024)
    (tmp_path / "t.tar.gz").write_bytes(gzip.compress(plain))
    result = packdata.convert(str(tmp_path / "t.tar.gz"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"corrupt tar": 1}
    [skip] = result.skip_examples
    assert skip["key"] == "t.tar.gz:a2"  # its next member's header is unread: a2 may lack a field, so it is dropped
    assert skip["detail"].startswith(f"the header at byte {at} claims ")
    assert f" bytes of {what}" in skip["detail"]
    assert ", more than the 16,777,216 read of them: a damaged tar?" in skip["detail"]
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a1"]


def test_a_tar_of_pax_headers_chained_past_tarfiles_recursion_is_a_corrupt_tar_not_a_failed_request(
    tmp_path: Path,
) -> None:
    """3,000 pax headers in a row (12 KB gzipped): tarfile's RecursionError stopped the run, 'rerun with resume'."""
    one = tarfile.TarInfo("b.txt")
    one.pax_headers = {"comment": "c"}
    pax_header = one.tobuf(format=tarfile.PAX_FORMAT)[:1024]  # the 'x' header and its records, without b's own
    plain = _member("a1.txt", b"1") + _member("a2.txt", b"2") + pax_header * 3000 + _member("b.txt", b"b")
    (tmp_path / "t.tar.gz").write_bytes(gzip.compress(plain + bytes(1024)))
    (tmp_path / "u.tar.gz").write_bytes(gzip.compress(_member("u.txt", b"u") + bytes(1024)))
    result = packdata.convert(str(tmp_path / "{t,u}.tar.gz"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and result.skipped == {"corrupt tar": 1}
    [skip] = result.skip_examples
    assert skip["key"] == "t.tar.gz:a2"
    assert skip["detail"] == (
        "damaged member header at byte 2048: more pax or long-name headers in a row than tarfile reads (one or two "
        "come before a member); the samples before this one in the tar are kept"
    )
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a1", "u"]


_NO_DATA_MEMBERS = {  # a member whose type holds no data, its header claiming 1024 bytes -> its name, kind, key
    "folder": (tarfile.DIRTYPE, "b", "folder", "b"),
    "hard link": (tarfile.LNKTYPE, "b.txt", "hard link", "b"),
    "symlink": (tarfile.SYMTYPE, "b.txt", "symlink", "b"),
    "symlink sized by pax": (tarfile.SYMTYPE, "b.txt", "symlink", "b"),
    "symlink of the sample before": (tarfile.SYMTYPE, "a2.cls", "symlink", "a2"),
    "character device": (tarfile.CHRTYPE, "b.txt", "character device", "b"),
    "block device": (tarfile.BLKTYPE, "b.txt", "block device", "b"),
    "fifo": (tarfile.FIFOTYPE, "b.txt", "FIFO", "b"),
}


@pytest.mark.parametrize("member", list(_NO_DATA_MEMBERS))
def test_a_folder_link_or_device_whose_header_claims_data_is_a_corrupt_tar_not_read_as_members(
    tmp_path: Path, member: str
) -> None:
    """A folder, link, device or FIFO header with a size: tarfile skips no data after those types, so the 1024 bytes
    it claims (a hidden member c.txt) were packed as a sample, where GNU tar -t skips them after a symlink, device or
    FIFO: one tar, other samples. It is a corrupt tar now, named at that member, the samples before it kept (the one
    it belongs to dropped), the next tar read."""
    kind, name, said, key = _NO_DATA_MEMBERS[member]
    header = tarfile.TarInfo(name)
    header.type, header.size = kind, 1024
    if kind in (tarfile.LNKTYPE, tarfile.SYMTYPE):
        header.linkname = "a1.txt"
    fmt = tarfile.USTAR_FORMAT
    if member == "symlink sized by pax":  # the ustar header says 0, its pax record 1024
        header.size, header.pax_headers, fmt = 0, {"size": "1024"}, tarfile.PAX_FORMAT
    special = header.tobuf(format=fmt)
    hidden = _member("c.txt", b"hidden", fmt=tarfile.USTAR_FORMAT)
    assert len(hidden) == 1024
    plain = _member("a1.txt", b"1") + _member("a2.txt", b"2") + special + hidden + _member("d.txt", b"d")
    (tmp_path / "t.tar").write_bytes(plain + bytes(1024))
    (tmp_path / "u.tar").write_bytes(_member("u.txt", b"u") + bytes(1024))
    result = packdata.convert(str(tmp_path / "{t,u}.tar"), tmp_path / "out.lmdb", progress=False)
    kept = ["a1", "u"] if key == "a2" else ["a1", "a2", "u"]
    assert sorted(s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")) == kept
    assert result.skipped == {"corrupt tar": 1}
    [skip] = result.skip_examples
    assert skip["key"] == f"t.tar:{key}"
    assert skip["detail"] == (
        f"the {said} {name!r} at byte 2048 claims 1,024 bytes of data, which a {said} never holds: tarfile reads "
        "them as the next members, tar -t may skip them (a damaged or crafted tar?); the samples before this one in "
        "the tar are kept"
    )


@pytest.mark.parametrize("header", ["base-256 -256", "base-256 -1024", "pax size -1024", "gnu long name -256"])
def test_a_tar_member_header_claiming_a_negative_size_is_a_corrupt_tar_not_an_empty_field(
    tmp_path: Path, header: str
) -> None:
    """tarfile takes a base-256 size or a pax size record below 0 (GNU tar refuses the header): -256 moved no byte,
    so b.txt was packed as an empty field and the tar read on; -1024 failed on the next header as 'seeking backwards
    is not allowed'; a GNU long name of -256 bytes renamed b.txt to a name of no field, skipped as 'no field'. Each is
    a corrupt tar now, named with the size it claims; a member's (its name known) keeps the whole sample before it."""
    size = int(header.rsplit(" ", 1)[1])
    if header.startswith("pax"):
        damaged = _member("b.txt", b"", pax={"size": str(size)})
    else:
        info = tarfile.TarInfo("././@LongLink" if header.startswith("gnu") else "b.txt")
        info.type = tarfile.GNUTYPE_LONGNAME if header.startswith("gnu") else tarfile.REGTYPE
        block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
        block[124:136] = b"\xff" + (size % 256**11).to_bytes(11, "big")  # GNU base-256: the number's two's complement
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\0 " % sum(block)
        assert tarfile.TarInfo.frombuf(bytes(block), "utf-8", "strict").size == size
        damaged = bytes(block) + (_member("b.txt", b"b") if header.startswith("gnu") else b"")
    plain = _member("a1.txt", b"1") + _member("a2.txt", b"2") + damaged + _member("c.txt", b"c") + bytes(1024)
    (tmp_path / "t.tar").write_bytes(plain)
    (tmp_path / "u.tar").write_bytes(_member("u.txt", b"u") + bytes(1024))
    result = packdata.convert(str(tmp_path / "{t,u}.tar"), tmp_path / "out.lmdb", progress=False)
    header_only = header.startswith("gnu")  # the long name's header: no member's name known, a2 may go on after it
    kept = ["a1", "u"] if header_only else ["a1", "a2", "u"]
    assert sorted(s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")) == kept
    assert result.skipped == {"corrupt tar": 1}
    [skip] = result.skip_examples
    if header_only:
        assert skip["key"] == "t.tar:a2"
        said = f"damaged member header at byte 2048: it claims {size:,} bytes"
    else:
        assert skip["key"] == "t.tar:b"
        said = f"the member 'b.txt' at byte 2048 claims {size:,} bytes: a damaged or crafted tar?"
    assert skip["detail"] == f"{said}; the samples before this one in the tar are kept"


def _gnu_sparse_member(name: str, extension_blocks: int) -> bytes:
    """An old GNU sparse header ('S') and its map's extension blocks, each of 21 chunks of 1 byte (none of its data)."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    header[482] = 1  # isextended: extension blocks follow
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    chunks = b"00000000001\0" * 2 * 21
    block = chunks + bytes(512 - len(chunks))
    more = block[:504] + b"\1" + block[505:]  # another extension block follows
    return bytes(header) + more * (extension_blocks - 1) + block * (extension_blocks > 0)


@pytest.mark.parametrize("sparse", ["gnu map", "pax map", "gnu map cut short"])
def test_a_tar_sparse_map_past_what_a_header_holds_or_cut_short_is_a_corrupt_tar_not_read_into_memory(
    tmp_path: Path, sparse: str
) -> None:
    """tarfile kept every chunk of a sparse map (40 MB, 39 KB gzipped: 1.1 GB); one cut short was an IndexError."""
    if sparse == "gnu map":
        damaged = _gnu_sparse_member("b.txt", 33_000) + _member("c.txt", b"c") + bytes(1024)
    elif sparse == "pax map":
        line = b"0" * 255 + b"1\n"  # the number 1 in 256 bytes: fewer lines to parse than "1\n"
        chunks = (17 << 20) // len(line * 2)
        pax = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "b.txt"}
        damaged = _member("GNUSparseFile.0/b.txt", b"%d\n" % chunks + line * 2 * chunks, pax=pax) + bytes(1024)
    else:
        damaged = _gnu_sparse_member("b.txt", 0)  # the tar ends where the map's first extension block should be
    plain = _member("a1.txt", b"1") + _member("a2.txt", b"2") + damaged
    (tmp_path / "t.tar.gz").write_bytes(gzip.compress(plain))
    (tmp_path / "u.tar.gz").write_bytes(gzip.compress(_member("u.txt", b"u") + bytes(1024)))
    result = packdata.convert(str(tmp_path / "{t,u}.tar.gz"), tmp_path / "out.lmdb", progress=False)
    assert result.packed == 2 and result.skipped == {"corrupt tar": 1}
    [skip] = result.skip_examples
    assert skip["key"] == "t.tar.gz:a2"
    problem = "the sparse member at byte 2048 has a map of more than 16,777,216 bytes: a damaged tar?"
    if sparse == "gnu map cut short":
        problem = "the tar ends in the sparse map of the member at byte 2048"
    assert skip["detail"] == f"{problem}; the samples before this one in the tar are kept"
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["a1", "u"]


def test_every_tarfile_method_the_checked_headers_override_is_one_tarfile_still_calls() -> None:
    """CheckedTarInfo bounds hostile headers by overriding tarfile's private readers: a Python whose tarfile
    renamed one would call its own, and the bound would be gone without a word. This names the rename."""
    from packdata.conversion.tar_headers import CheckedTarInfo, check_tarfile

    overridden = [name for name in vars(CheckedTarInfo) if name.startswith("_proc")]
    assert sorted(overridden) == ["_proc_gnusparse_10", "_proc_member", "_proc_sparse"]
    missing = [name for name in overridden if not callable(getattr(tarfile.TarInfo, name, None))]
    assert not missing, f"this Python's tarfile.TarInfo has no {missing}: the tar header bounds do not apply"
    check_tarfile("t.tar")  # the runtime guard passes this Python's tarfile: it calls each of them


_TARFILE_CHANGED = {  # how a future Python's tarfile differs -> what the refusal names
    "a method renamed": (
        "delattr(tarfile.TarInfo, '_proc_sparse')",
        "tarfile.TarInfo has no _proc_sparse(self, tarfile)",
    ),
    "a method reshaped": (
        "tarfile.TarInfo._proc_gnusparse_10 = lambda self, member, headers, tar: None",
        "tarfile.TarInfo has no _proc_gnusparse_10(self, next, pax_headers, tarfile)",
    ),
    "a method no longer called": (  # _proc_member reads an old GNU sparse member as a plain one
        "own = tarfile.TarInfo._proc_member\n"
        "def _proc_member(self, tarfile):\n"
        "    return self._proc_builtin(tarfile) if self.type == b'S' else own(self, tarfile)\n"
        "tarfile_module.TarInfo._proc_member = _proc_member",
        "tarfile no longer calls TarInfo._proc_sparse reading a member of its kind",
    ),
}


@pytest.mark.parametrize("changed", list(_TARFILE_CHANGED))
def test_a_python_whose_tarfile_bypasses_the_header_bounds_refuses_tars_naming_its_version(
    tmp_path: Path, changed: str
) -> None:
    """CheckedTarInfo bounds hostile headers by overriding three private tarfile methods; a Python that renamed,
    reshaped or stopped calling one would read tars unbounded without a word. Such a tarfile (patched so in a child
    Python: no real one differs yet) is now refused before any tar is read, in one line naming the Python version."""
    patch, problem = _TARFILE_CHANGED[changed]
    tar = tmp_path / "t.tar"
    tar.write_bytes(_member("a.txt", b"a") + bytes(1024))
    dst = tmp_path / "out.lmdb"
    code = f"import sys, tarfile, tarfile as tarfile_module\n{patch}\nfrom packdata.cli import main\nmain(sys.argv[1:])"
    proc = subprocess.run(
        [sys.executable, "-c", code, "convert", str(tar), str(dst), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    version = platform.python_version()
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (
        f"Error: {tar}: this Python's tarfile ({version}) is not the one packdata bounds hostile tar headers in "
        f"({problem}): its tars are not read, rather than read unbounded. Convert with a Python whose tarfile "
        "packdata knows (3.11 to 3.13), or extract the tars with tar and convert the folder\n"
    )
    assert not dst.exists() and not partial_path(dst).exists()


@pytest.mark.parametrize("damage", ["cut in its data", "negative size", "unreadable header"])
def test_a_tar_damaged_at_its_first_member_remembers_that_members_key_when_its_header_names_one(
    tmp_path: Path, damage: str
) -> None:
    """A tar damaged at its very first member named no key ('t-0.tar', 'no sample of this tar is packed'), so a later
    tar's sample of that member's key was packed while 997590b skips a later tar's sample of any key skipped before.
    Now a first member whose header was read (its data cut, or a size below 0) gives its key, skipped and remembered:
    t-1's a is a 'duplicate key' skip. An unreadable header names nothing: nothing is remembered, a is packed."""
    first, second = tmp_path / "t-0.tar", tmp_path / "t-1.tar"
    if damage == "cut in its data":
        plain = _member("a.bin", b"A" * 3000)[:1536]  # its header and 1,024 of its 3,000 bytes
        said = "member 'a.bin' claims 3000 bytes, past the tar's end (byte 1536)"
    else:
        info = tarfile.TarInfo("a.bin")
        block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
        block[124:136] = b"\xff" + (-256 % 256**11).to_bytes(11, "big")  # GNU base-256 -256
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\0 " % (sum(block) + (damage == "unreadable header"))  # 1 off: a bad checksum
        plain = bytes(block) + _member("b.bin", b"B") + bytes(1024)
        said = "the member 'a.bin' at byte 0 claims -256 bytes: a damaged or crafted tar?"
    first.write_bytes(plain)
    second.write_bytes(_member("a.bin", b"a") + _member("c.bin", b"c") + bytes(1024))
    out = tmp_path / "out.lmdb"
    result = packdata.convert(str(tmp_path / "t-{0..1}.tar"), out, progress=False)
    got = [(s["key"], s["reason"], s["detail"]) for s in result.skip_examples]
    if damage == "unreadable header":
        assert [s["__key__"] for s in packdata.LMDBDataset(out)] == ["a", "c"]
        assert [(key, reason) for key, reason, _ in got] == [("t-0.tar", "corrupt tar")]
        assert got[0][2].endswith("; no sample of this tar is packed")
        return
    assert [s["__key__"] for s in packdata.LMDBDataset(out)] == ["c"]
    earlier = f"an earlier sample in {first} has this key ({second})"
    assert got == [
        ("t-0.tar:a", "corrupt tar", f"{said}; the samples before this one in the tar are kept"),
        ("a", "duplicate key", f"{earlier}; that one was skipped (reported): this one is never packed in its place"),
    ]
