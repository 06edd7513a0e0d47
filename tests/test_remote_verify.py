"""verify, ls and cat of a pack at a URL: every record checked, damage named by URL, no credentials."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import SECRET, help_text, image_bytes
from remote_helpers import _cli, _convert_to_s3

import packdata
from packdata.cli import main
from packdata.errors import ConfigError, PackFormatError
from packdata.units import format_size

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")


def test_verify_a_remote_tfrecord_pack_checks_every_record(s3, remote_tfrecord) -> None:
    options, _ = s3
    url, local = remote_tfrecord
    result = packdata.verify_pack(url, storage_options=options, progress=False, workers=2)
    here = packdata.verify_pack(local, progress=False)
    assert (result.path, result.checks) == (url, "records")
    assert (
        (result.records, result.bytes, result.shards) == (here.records, here.bytes, here.shards) == (14, here.bytes, 4)
    )
    out = _cli("verify", url, "-q", "--json", options=options)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {
        "ok": True,
        "path": url,
        "records": 14,
        "bytes": here.bytes,
        "shards": 4,
        "checks": "records",
    }


@pytest.mark.parametrize("tables", ["all", "one missing", "none"])
def test_verify_of_a_remote_lmdb_pack_says_which_records_were_checked(s3, remote_pack, tables: str) -> None:
    """Every records.i64 row is checked against its record, yet the output said 'Records NOT checked' of every LMDB
    pack at a URL (and --json counted 0 records): it now counts the records checked through their rows, and says
    NOT checked only of the shards without the table (size and SHA-256 only)."""
    options, fs = s3
    url = f"s3://packs/tables-{tables.replace(' ', '-')}.lmdb"
    fs.put(str(remote_pack[1]), url[5:], recursive=True)
    missing = {"all": [], "one missing": ["shard-00001.lmdb"], "none": [f"shard-0000{i}.lmdb" for i in range(3)]}
    for shard in missing[tables]:
        fs.rm_file(f"{url[5:]}/{shard}/records.i64")
    result = packdata.verify_pack(url, storage_options=options, progress=False)
    records = 18 - 6 * len(missing[tables])
    checks = "checksums" if tables == "none" else "rows"
    assert (result.checks, result.records, result.shards, result.unchecked_shards) == (
        checks,
        records,
        3,
        missing[tables],
    )
    out = _cli("verify", url, "-q", "--json", options=options)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {
        "ok": True,
        "path": url,
        "records": records,
        "bytes": result.bytes,
        "shards": 3,
        "checks": checks,
        "unchecked_shards": missing[tables],
    }
    out = _cli("verify", url, "-q", options=options)
    assert out.exit_code == 0, out.output
    stage = f"packdata stage {url} --to DIR, then packdata verify the staged copy"
    checked = {
        "all": f"{records} records checked through their records.i64 rows (record header and CRC-32; key, label "
        f"and size against the sample index; row CRC32C). LMDB's own pages and a multi-field sample's fields are "
        f"checked in local files ({stage})",
        "one missing": f"{records} records checked through their records.i64 rows (record header and CRC-32; key, "
        "label and size against the sample index; row CRC32C). Records NOT checked in 1 shard without the table "
        f"(shard-00001.lmdb). LMDB's own pages and a multi-field sample's fields are checked in local files ({stage})",
        "none": f"Records NOT checked: no shard has a records.i64 table to check them by at a URL ({stage})",
    }[tables]
    assert out.output == (
        f"ok: 3 shards, {format_size(result.bytes)}: sizes and SHA-256 match the manifest. {checked}\n"
    )


def test_verify_help_says_what_is_checked_of_an_lmdb_pack_at_a_url() -> None:
    """The help said only 'checksums (and the binding of each records.i64 table to its shard)' were checked of an
    LMDB pack at a URL, while every row of the table is checked against the record it places (the test below)."""
    taught = (
        "PACK may be a URL (s3://...), verified in place without staging: the sample index's SHA-256, the counts, "
        "skip report and labels are checked, and every shard is read once and its size and SHA-256 checked "
        "against the manifest. A TFRecord pack's records are checked as for a local pack (framing, CRCs, index, "
        "keys, labels, fields) while its shards stream. An LMDB pack's records are read through LMDB, which needs "
        "a local file, so at a URL each row of a shard's records.i64 table is checked against the record it "
        "places as the shard streams (the record's header and CRC-32, its key, label and size against the sample "
        "index, the row's CRC32C; a shard without the table: its size and SHA-256 only), but neither LMDB's own "
        "pages nor the fields of a multi-field sample are, and the output says which records were checked: stage "
        "it and verify the staged copy for every check."
    )
    assert help_text("verify").count(taught) == 1


@pytest.mark.parametrize("damage", ["swap", "elsewhere"])
def test_verify_of_a_remote_lmdb_pack_checks_every_row_of_its_location_table(
    s3, remote_pack, tmp_path: Path, damage: str
) -> None:
    """records.i64 rows swapped, or one row pointing at another record (the table's size kept): a remote verify
    passed it (only the table's header was checked), a local verify of the same pack named the row."""
    options, fs = s3
    fs.put(str(remote_pack[1]), f"packs/{damage}.lmdb", recursive=True)
    table = f"packs/{damage}.lmdb/shard-00001.lmdb/records.i64"
    rows = np.frombuffer(fs.cat_file(table), dtype="<i8").reshape(-1, 3).copy()
    if damage == "swap":
        rows[[3, 4]] = rows[[4, 3]]  # after the two header rows: records 1 and 2 of the shard
    else:
        rows[3] = rows[5]  # record 1's row points at record 3's payload
    fs.pipe_file(table, rows.tobytes())
    wrong = "2 rows wrong" if damage == "swap" else "1 rows wrong"
    local = tmp_path / "local"
    fs.get(f"packs/{damage}.lmdb", str(local), recursive=True)
    with pytest.raises(PackFormatError, match=rf"records\.i64 row 1 does not point at record 1 \({wrong}\)"):
        packdata.verify_pack(local, progress=False)
    out = _cli("verify", f"s3://packs/{damage}.lmdb", "-q", options=options)
    assert out.exit_code == 1, out.output
    assert out.output.startswith(
        f"Error: s3://packs/{damage}.lmdb/shard-00001.lmdb/records.i64: "
        f"records.i64 row 1 does not point at record 1 ({wrong})"
    ), out.output


def test_verify_names_a_damaged_remote_object(s3, remote_pack, remote_tfrecord) -> None:
    options, fs = s3
    fs.put(str(remote_tfrecord[1]), "packs/bad-tf", recursive=True)
    shard = "packs/bad-tf/verify-tf-00002-of-00004.tfrecord"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(PackFormatError, match=r"s3://packs/bad-tf/verify-tf-00002-of-00004\.tfrecord: record at byte"):
        packdata.verify_pack("s3://packs/bad-tf", storage_options=options, progress=False)
    fs.put(str(remote_tfrecord[1]), "packs/noreport-tf", recursive=True)
    fs.rm_file("packs/noreport-tf/skipped.jsonl")
    with pytest.raises(PackFormatError, match=r"^s3://packs/noreport-tf: the manifest counts 1 skipped files, but"):
        packdata.verify_pack("s3://packs/noreport-tf", storage_options=options, progress=False)
    fs.put(str(remote_pack[1]), "packs/bad-verify.lmdb", recursive=True)
    mdb = "packs/bad-verify.lmdb/shard-00001.lmdb/data.mdb"
    data = bytearray(fs.cat_file(mdb))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(mdb, bytes(data))
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert out.exit_code == 1
    assert out.output.startswith(
        "Error: s3://packs/bad-verify.lmdb/shard-00001.lmdb/data.mdb: shard checksum does not match the manifest"
    )
    fs.rm_file("packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb")
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert "shard-00001.lmdb/data.mdb: shard checksum" in out.output  # the first bad shard in manifest order
    fs.pipe_file(mdb, fs.cat_file("packs/train.lmdb/shard-00001.lmdb/data.mdb"))
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert out.output.startswith("Error: s3://packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb: shard file is missing")
    fs.pipe_file("packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb/part", b"x")  # a prefix where the shard was
    out = _cli("verify", "s3://packs/bad-verify.lmdb", "-q", options=options)
    assert out.output.startswith(
        "Error: s3://packs/bad-verify.lmdb/shard-00002.lmdb/data.mdb: is a folder (a prefix of other objects), not"
    ), out.output


@pytest.mark.parametrize("table", ["tfindex", "records.i64"])
def test_verify_names_a_damaged_remote_side_table_by_its_url(s3, remote_pack, remote_tfrecord, table: str) -> None:
    """A malformed .tfindex was named by its copy in verify's temporary folder, deleted by then
    ('/tmp/packdata-verify-x/pack/NAME.tfindex: offsets index is malformed'). An LMDB location table's error,
    raised while its shard streams, is named by its URL too, with its path and hint."""
    options, fs = s3
    if table == "tfindex":
        url, rel = "s3://packs/bad-tfindex", "verify-tf-00001-of-00004.tfindex"
        fs.put(str(remote_tfrecord[1]), url, recursive=True)
        fs.pipe_file(f"{url}/{rel}", fs.cat_file(f"{url}/{rel}").replace(b"\n", b" 1\n", 1))
        expected = "offsets index is malformed"
    else:
        url, rel = "s3://packs/bad-table.lmdb", "shard-00001.lmdb/records.i64"
        fs.put(str(remote_pack[1]), url, recursive=True)
        rows = np.frombuffer(fs.cat_file(f"{url}/{rel}"), dtype="<i8").reshape(-1, 3).copy()
        rows[3] = rows[5]
        fs.pipe_file(f"{url}/{rel}", rows.tobytes())
        expected = "records.i64 row 1 does not point at record 1"
    with pytest.raises(PackFormatError) as caught:
        packdata.verify_pack(url, storage_options=options, progress=False)
    assert caught.value.path == f"{url}/{rel}" and caught.value.message.startswith(expected)
    assert caught.value.hint and "packdata-verify-" not in str(caught.value)


def test_ls_and_cat_read_a_remote_pack_in_place(s3, remote_pack, remote_tfrecord, tmp_path: Path) -> None:
    from packdata.formats.contents import read_field

    options, _ = s3
    for url, local in (remote_pack, remote_tfrecord):
        listed = _cli("ls", url, "--limit", "0", "--json", options=options)
        assert listed.exit_code == 0, listed.output
        assert listed.output == CliRunner().invoke(main, ["ls", str(local), "--limit", "0", "--json"]).output
        keys = [json.loads(line)["key"] for line in listed.output.splitlines()]
        for which in (keys[0], keys[-1], "#5"):
            got = CliRunner().invoke(main, ["cat", url, which, "--storage-options", json.dumps(options)])
            assert got.exit_code == 0, got.output
            assert got.stdout_bytes == read_field(local, which) and got.stdout_bytes[:3] == b"\xff\xd8\xff"
        label = CliRunner().invoke(
            main, ["cat", url, keys[-1], "--field", "cls", "--storage-options", json.dumps(options)]
        )
        assert label.stdout_bytes == b"1"
        missing = _cli("cat", url, "nope/0.jpg", options=options)
        assert missing.exit_code == 1 and missing.output.startswith(f"Error: {url}: no sample has the key 'nope/0.jpg'")


def test_ls_never_lists_labels_of_a_damaged_index(s3, remote_tfrecord, tmp_path: Path, monkeypatch) -> None:
    """ls listed a cached copy's (or a local pack's) flipped labels.i32 as the samples' labels, silently.

    The cached copy is downloaded again; a local pack's damaged file is named.
    """
    options, _ = s3
    url, local = remote_tfrecord
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default cache of ls and cat
    expected = _cli("ls", url, "--limit", "0", "--json", options=options).output
    assert '"label": 1' in expected

    def flip_first_label(labels: Path) -> None:
        damaged = bytearray(labels.read_bytes())
        damaged[0] ^= 0x01
        labels.write_bytes(bytes(damaged))

    (cached,) = (tmp_path / f"packdata-remote-{os.getuid()}").rglob("labels.i32")
    flip_first_label(cached)
    assert _cli("ls", url, "--limit", "0", "--json", options=options).output == expected
    assert cached.read_bytes() == (local / "index" / "labels.i32").read_bytes()
    flip_first_label(cached)
    assert _cli("cat", url, "#0", "--field", "cls", options=options).stdout_bytes == b"0"
    copy = tmp_path / "copy"
    shutil.copytree(local, copy)
    flip_first_label(copy / "index" / "labels.i32")
    out = CliRunner().invoke(main, ["ls", str(copy)])
    assert out.exit_code == 1 and out.output.startswith(f"Error: {copy / 'index' / 'labels.i32'}: "), out.output


def test_cat_of_an_lmdb_shard_without_its_location_table_says_stage_it(s3, remote_pack) -> None:
    options, fs = s3
    fs.put(str(remote_pack[1]), "packs/notable.lmdb", recursive=True)
    fs.rm_file("packs/notable.lmdb/shard-00000.lmdb/records.i64")
    out = _cli("cat", "s3://packs/notable.lmdb", "#0", options=options)
    assert out.exit_code == 1 and len(out.output.strip().splitlines()) == 1
    assert "has none that fits" in out.output, out.output
    url = "s3://packs/notable.lmdb"  # what a Python caller passes, and the command line
    assert f"Stage the pack first (packdata.stage({url!r}, to=DIR); `packdata stage {url} --to DIR`)" in out.output
    assert _cli("cat", "s3://packs/notable.lmdb", "#7", options=options).exit_code == 0  # another shard has its table


def test_cat_never_prints_another_record_that_an_lmdb_location_table_points_at(s3, tmp_path: Path, monkeypatch) -> None:
    """records.i64 rows of two records of the same size swapped: cat of the first printed the second's bytes."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url = "s3://packs/swapped.lmdb"
    _convert_to_s3(tmp_path / "src", "A", url, options, "lmdb")
    (table,) = fs.glob("packs/swapped.lmdb/*/records.i64")
    rows = np.frombuffer(fs.cat_file(table), dtype="<i8").reshape(-1, 3).copy()
    rows[[2, 3]] = rows[[3, 2]]  # after the two header rows: records 0 and 1
    fs.pipe_file(table, rows.tobytes())
    out = _cli("cat", url, "x/0.txt", options=options)
    assert out.exit_code == 1 and out.stdout_bytes == b"", out.output
    assert re.match(rf"Error: {url}/.*/data\.mdb: record 0 \(key 'x/1\.txt'\) does not match the sample", out.output)
    assert _cli("cat", url, "x/2.txt", options=options).stdout_bytes == b"Ax2" * 100  # a row of its own record


def test_a_cached_side_table_cat_finds_damaged_is_downloaded_again(
    s3, remote_pack, tmp_path: Path, monkeypatch
) -> None:
    """A cached records.i64 whose rows were swapped in place (same size, a change its stamps cannot see: within
    the timestamp tick, or a failing disk): cat named the record damaged, rightly, but every later cat and
    dataset reused the copy and named it too, though the pack at the URL is sound, until the cache was deleted."""
    from packdata.pack.files import file_stamp

    options, _ = s3
    url, local = remote_pack
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default cache of cat
    expected = _cli("cat", url, "#0", options=options).stdout_bytes
    assert expected == packdata.LMDBDataset(local, decode="bytes")[0][0]
    (table,) = (tmp_path / f"packdata-remote-{os.getuid()}").rglob("shard-00000.lmdb/records.i64")
    rows = np.fromfile(table, dtype="<i8").reshape(-1, 3)
    rows[[2, 3]] = rows[[3, 2]]  # after the two header rows: records 0 and 1
    rows.tofile(table)
    (record,) = table.parents[1].glob(".files.json")
    stamps = json.loads(record.read_text())
    record.write_text(json.dumps({name: file_stamp(record.parent / name) for name in stamps}))
    out = _cli("cat", url, "#0", options=options)
    assert out.exit_code == 1 and out.stdout_bytes == b"", out.output
    assert re.match(
        rf"Error: {url}/shard-00000\.lmdb/data\.mdb: record 0 \(key 'cat/1\.jpg'\) does not match the sample index",
        out.output,
    ), out.output
    assert _cli("cat", url, "#0", options=options).stdout_bytes == expected
    assert table.read_bytes() == (local / "shard-00000.lmdb" / "records.i64").read_bytes()


def test_verify_ls_and_cat_never_print_credentials(s3, remote_pack, remote_tfrecord) -> None:
    options, _ = s3
    keyed = {**options, "key": "testing-key-id", "secret": SECRET}  # credentials in storage_options
    down = {
        **keyed,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    for url, _ in (remote_pack, remote_tfrecord):
        for args in (["verify", url], ["ls", url], ["cat", url, "#0", "--field", "cls"]):
            out = _cli(*args, options=keyed)  # with progress on stderr
            assert out.exit_code == 0, out.output
            assert SECRET not in out.output and "testing-key-id" not in out.output
            secret_url = url.replace("s3://", f"s3://testing-key-id:{SECRET}@")
            for failing in ([args[0], secret_url, *args[2:]], args):
                out = _cli(*failing, options=down)
                assert out.exit_code == 1 and out.output.startswith(f"Error: {url}: cannot read manifest.json")
                assert SECRET not in out.output and "testing-key-id" not in out.output


def test_a_field_some_samples_of_a_pack_at_a_url_lack_is_refused_naming_the_url(tmp_path: Path) -> None:
    """TFRecordDataset(url, fields=(..., "txt")) over a pack where some samples have no txt named the local cache
    folder holding its manifest and index, not the pack the user gave; missing= reads it as locally."""
    import fsspec

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"s{i}.jpg").write_bytes(image_bytes(i))
        if i % 2:
            (src / f"s{i}.txt").write_text(f"caption {i}", encoding="utf-8")
    pack = tmp_path / "pack"
    packdata.convert(src, pack, format="tfrecord", progress=False)
    memory = fsspec.filesystem("memory")
    memory.put(str(pack), "/fields-bucket/train", recursive=True)
    url = "memory://fields-bucket/train"
    try:
        with pytest.raises(ConfigError, match=re.escape(f"{url}: fields asks for 'txt', which 2 of the pack's 4")):
            packdata.TFRecordDataset(url, fields=("__key__", "txt"), cache_dir=tmp_path / "cache")
        ds = packdata.TFRecordDataset(
            url, fields=("__key__", "txt"), missing={"txt": None}, shuffle=False, cache_dir=tmp_path / "cache"
        )
        assert list(ds) == [("s0", None), ("s1", "caption 1"), ("s2", None), ("s3", "caption 3")]
    finally:
        memory.rm("/fields-bucket", recursive=True)
