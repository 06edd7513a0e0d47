"""A store, or a proxy, that ignores a ranged read's Range header: the reply is refused naming the store, never read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import faulty_s3, tar_with_a_hard_link
from remote_helpers import _cli, _convert_to_s3

import packdata
from packdata.errors import SourceError

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")

_IGNORED = r"asked for bytes (\d+)-(\d+), the store answered HTTP 200 with (\d+) bytes and no byte range: it ignored"
_HINT = r"or changed the byte range\. The endpoint, or a proxy in front of it, does not honour Range requests"


def _no_range(rules: dict, fs, root: str, suffix: str) -> list[str]:
    """Every object under ``root`` whose name ends with ``suffix`` relayed without its Range header; their paths."""
    fs.invalidate_cache()
    objects = sorted(p for p in fs.find(root) if p.endswith(suffix))
    for path in objects:
        rules["GET", f"/{path}"] = ["no-range", 0]
    return objects


def test_a_tfrecord_pack_streamed_through_a_store_that_ignores_range_is_refused_naming_the_store(
    s3, tmp_path: Path
) -> None:
    """The span GET of a run starting mid-shard got the whole object (HTTP 200) and took its first bytes for the
    run's: the error blamed the shard ('damaged ... run packdata verify'). Now the reply is refused, named."""
    options, fs = s3
    url = "s3://packs/ranges-tf"
    _convert_to_s3(tmp_path / "src", "A", url, options, shard_samples=4)
    ds = packdata.TFRecordDataset(url, decode="bytes", shuffle=False, storage_options=options, cache_dir=tmp_path)
    it = iter(ds)
    head = [next(it)[0] for _ in range(2)]  # half of the first shard
    state = ds.state_dict()
    with faulty_s3(options) as (faulty, rules, _):
        shards = _no_range(rules, fs, "packs/ranges-tf", ".tfrecord")
        resumed = packdata.TFRecordDataset(
            url, decode="bytes", shuffle=False, storage_options=faulty, cache_dir=tmp_path
        )
        resumed.load_state_dict(state)
        with pytest.raises(SourceError) as raised:
            list(resumed)
    assert len(head) == 2 and len(shards) == 3
    found = re.fullmatch(rf"(s3://packs/ranges-tf/[^:]+): {_IGNORED} {_HINT}.*", str(raised.value))
    assert found, str(raised.value)
    assert found[1] == f"s3://{shards[0]}" and int(found[2]) > 0  # the first shard, from its third record
    assert int(found[4]) == fs.size(shards[0])  # the whole object answered


def test_an_lmdb_record_read_through_a_store_that_ignores_range_is_refused_naming_the_store(s3, tmp_path: Path) -> None:
    """cat read one record of an LMDB pack at a URL in one ranged GET (If-Match): the whole data.mdb came back, its
    first bytes were taken for the record, and the error said the record was damaged. Now the reply is refused."""
    options, fs = s3
    url = "s3://packs/ranges-lmdb"
    _convert_to_s3(tmp_path / "src", "B", url, options, fmt="lmdb")
    assert _cli("cat", url, "x/1.txt", options=options).stdout_bytes == b"Bx1" * 100
    with faulty_s3(options) as (faulty, rules, hits):
        (shard,) = _no_range(rules, fs, "packs/ranges-lmdb", "/data.mdb")
        out = _cli("cat", url, "x/1.txt", options=faulty)
    assert out.exit_code == 1 and out.stdout_bytes == b"", out.output
    found = re.fullmatch(rf"Error: s3://{shard}: {_IGNORED} {_HINT}.*\n", out.output)
    assert found and int(found[1]) > 0 and int(found[3]) == fs.size(shard), out.output
    assert hits["GET", f"/{shard}"] == 1  # refused at once: no retry helps


def test_a_reply_longer_than_the_range_asked_for_is_refused_never_cut(s3, tmp_path: Path) -> None:
    """fetch_range took a longer reply (a backend that ignores ranges: here fsspec's HTTP one) as a short read and
    retried it 4 times, then blamed the network. Now it is refused at once, naming the store."""
    fsspec = pytest.importorskip("fsspec")
    from packdata.formats.remote_reads import fetch_range

    options, fs = s3
    fs.pipe_file("packs/ranges-plain", bytes(range(256)) * 4)
    fs.chmod("packs/ranges-plain", "public-read")  # read anonymously, as fsspec's HTTP backend asks
    with faulty_s3(options) as (faulty, rules, hits):
        rules["GET", "/packs/ranges-plain"] = ["no-range", 0]
        http = fsspec.filesystem("http", skip_instance_cache=True)
        address = f"{faulty['client_kwargs']['endpoint_url']}/packs/ranges-plain"
        with pytest.raises(SourceError) as raised:
            fetch_range(http, address, "s3://packs/ranges-plain", 100, 200, backoff=1)
        sliced = fetch_range(fs, "packs/ranges-plain", "s3://packs/ranges-plain", 100, 200)  # no rule: honoured
    assert str(raised.value).startswith(
        "s3://packs/ranges-plain: asked for bytes 100-199, the store answered 1024 bytes: it ignored or changed the "
        "byte range. The endpoint, or a proxy in front of it, does not honour Range requests"
    ), str(raised.value)
    assert hits["GET", "/packs/ranges-plain"] == 1 and sliced == (bytes(range(256)) * 4)[100:200]


def test_a_stage_through_a_store_that_ignores_range_is_refused_naming_the_store(s3, tmp_path: Path, monkeypatch):
    """stage's ranged download of a shard got the whole object: the store's refusal was wrapped as a failed request
    ('cannot read ...; rerun to resume (_RangeIgnored)'), which no rerun helps. Now it is raised as it is."""
    import packdata.staging.fetch as fetch

    options, fs = s3
    url = "s3://packs/ranges-stage"
    _convert_to_s3(tmp_path / "src", "C", url, options, fmt="lmdb")
    monkeypatch.setattr(fetch, "_RANGE", 4096)  # every shard in several ranged requests
    with faulty_s3(options) as (faulty, rules, _):
        (shard,) = _no_range(rules, fs, "packs/ranges-stage", "/data.mdb")
        with pytest.raises(SourceError) as raised:
            packdata.stage(url, to=tmp_path / "cache", storage_options=faulty, progress=False, workers=1)
    found = re.fullmatch(rf"s3://{shard}: {_IGNORED} {_HINT}.*", str(raised.value))
    assert found and int(found[2]) - int(found[1]) == 4095 and int(found[3]) == fs.size(shard) > 4096, str(raised.value)


def test_a_hard_link_in_a_tar_read_through_a_store_that_ignores_range_is_refused_naming_the_store(
    s3, tmp_path: Path
) -> None:
    """A hard link's ranged read of its target's bytes got the whole tar: sample b was skipped as a 'corrupt tar'
    ("a hard link's member holds N of its 11 bytes", N the tar's size), blaming the tar. Now the store's refusal
    is raised, as it is, naming the tar's URL: the read goes through packdata's own GET at the tar's version, so
    the reply's status and headers are checked (HTTP 200, no Content-Range), not only its length."""
    options, fs = s3
    tar_with_a_hard_link(tmp_path / "src", tmp_path / "data.tar")
    fs.put_file(str(tmp_path / "data.tar"), "packs/ranges-tar/data.tar")
    with faulty_s3(options) as (faulty, rules, _):
        (tar,) = _no_range(rules, fs, "packs/ranges-tar", ".tar")
        with pytest.raises(SourceError) as raised:
            packdata.convert(f"s3://{tar}", tmp_path / "out.lmdb", storage_options=faulty, progress=False)
    said = str(raised.value)
    found = re.fullmatch(rf"s3://{tar}: {_IGNORED} {_HINT}.*", said)  # the reply's headers checked, read at its version
    target = (tmp_path / "data.tar").read_bytes().index(b"one caption")  # a.txt's bytes, which b.txt links to
    assert found and (int(found[1]), int(found[2])) == (target, target + len("one caption") - 1), said
    assert int(found[3]) == fs.size(tar), said  # the whole tar answered
