"""Publishing a pack into a URL: what a stranger wrote at the URL meanwhile is kept, never overwritten."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import faulty_s3
from remote_helpers import _two_classes, changed_since_message

import packdata
from packdata.errors import ConfigError

pytest.importorskip("moto.server", reason="the tests' S3 server needs moto[server] (the dev extra)")
s3fs = pytest.importorskip("s3fs", reason="s3:// needs s3fs (pip install 'packdata[s3]')")

STRANGER = b'{"a stranger": "published this"}'


def _stranger_puts_first(monkeypatch, fs, key: str) -> list[str]:
    """Right before the conversion's first PUT of the object ``key`` (in bucket ``packs``) leaves this process, a
    stranger's PUT of ``STRANGER`` there reaches the moto server. The PUTs go through ``fs``'s real ``_call_s3``
    (fsspec caches filesystems: the conversion gets this very instance). Returns the keys the stranger put."""
    real = fs._call_s3
    done: list[str] = []

    async def stranger_first(method, *args, **kwargs):
        if method in ("put_object", "create_multipart_upload") and kwargs.get("Key") == key and not done:
            done.append(key)
            await real("put_object", Bucket="packs", Key=key, Body=STRANGER)
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", stranger_first)
    return done


def _refused_with_a_stranger_first(s3, tmp_path: Path, monkeypatch, url: str, name: str) -> str:
    """Convert 10 JPEGs (5 a shard) into ``url``, a stranger's PUT of the pack's object ``name`` reaching the server
    right before the conversion's (see :func:`_stranger_puts_first`); the refusal's one line, once the stranger's
    object is found intact."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    key = f"{url.removeprefix('s3://packs/')}/{name}"
    put = _stranger_puts_first(monkeypatch, fs, key)
    with pytest.raises(ConfigError) as raised:
        packdata.convert(src, url, storage_options=options, shard_samples=5, progress=False)
    assert put == [key]
    fs.invalidate_cache()
    assert fs.cat_file(f"packs/{key}") == STRANGER
    return str(raised.value)


def test_a_manifest_put_between_the_last_look_and_the_publish_is_refused_not_overwritten(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """upload_pack looked for a manifest at the URL (a HEAD), then put its own: a stranger's manifest put between
    the two was overwritten. On S3 the manifest's PUT carries If-None-Match: *, and the store's 412 refuses it."""
    url = "s3://packs/gap.lmdb"
    assert _refused_with_a_stranger_first(s3, tmp_path, monkeypatch, url, "manifest.json") == changed_since_message(url)


def test_a_store_that_refuses_if_none_match_still_takes_the_manifest(s3, tmp_path: Path, monkeypatch) -> None:
    """A store that answers the conditional PUT with 501 NotImplemented gets the manifest after a look (HEAD)."""
    options, _ = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 8)
    url, manifest = "s3://packs/no-conditional-put.lmdb", "/packs/no-conditional-put.lmdb/manifest.json"
    with faulty_s3(options) as (faulty, rules, hits):
        rules["PUT", manifest] = [501, 1]
        result = packdata.convert(src, url, storage_options=faulty, shard_samples=5, progress=False)
    assert hits["PUT", manifest] == 2 and hits["HEAD", manifest] >= 1 and result.pack == url
    assert len(packdata.LMDBDataset(packdata.stage(url, to=tmp_path / "cache", storage_options=options).staged)) == 10


def test_a_strangers_object_at_a_shards_name_is_refused_not_overwritten(s3, tmp_path: Path, monkeypatch) -> None:
    """A stranger's object at a shard's name (its pack uploading there while this one's shards went up) was
    overwritten by this conversion's shard. Without overwrite=True, a shard the journal does not hold goes up with
    If-None-Match: *: the store's 412 keeps the stranger's object, and no manifest is published over it."""
    url = "s3://packs/strangers-shard.lmdb"
    refused = _refused_with_a_stranger_first(s3, tmp_path, monkeypatch, url, "shard-00001.lmdb/data.mdb")
    assert refused == (
        f"{url}: shard-00001.lmdb/data.mdb is there, and this conversion did not upload it (another conversion "
        "uploading there now?): it was not overwritten. Choose another URL, or pass overwrite=True to replace what "
        "is there (with resume=True, nothing packed is lost)"
    )
    options, fs = s3
    assert not fs.exists("packs/strangers-shard.lmdb/manifest.json")
    again = {"storage_options": options, "shard_samples": 5, "progress": False}  # as the hint says: the pack waits
    result = packdata.convert(tmp_path / "src", url, resume=True, overwrite=True, **again)
    assert result.packed == 10
    fs.invalidate_cache()
    assert fs.cat_file("packs/strangers-shard.lmdb/shard-00001.lmdb/data.mdb") != STRANGER


def test_an_object_with_this_conversions_bytes_at_a_shards_name_is_taken_not_refused(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """A shard's object whose upload the journal missed (the run killed between the PUT and its journal line) holds
    this conversion's bytes: the conditional PUT's 412 is then this conversion's own object, taken as uploaded."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 10)
    local = tmp_path / "local" / "own-bytes.lmdb"  # same source and options: the same bytes (shard names follow it)
    packdata.convert(src, local, shard_samples=5, progress=False)
    shard = "shard-00000.lmdb/data.mdb"
    fs.put_file(str(local / shard), f"packs/own-bytes.lmdb/{shard}")
    result = packdata.convert(
        src, "s3://packs/own-bytes.lmdb", storage_options=options, shard_samples=5, progress=False
    )
    assert result.packed == 10
    fs.invalidate_cache()
    assert fs.cat_file(f"packs/own-bytes.lmdb/{shard}") == (local / shard).read_bytes()
