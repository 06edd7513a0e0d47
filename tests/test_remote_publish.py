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


def test_a_manifest_put_between_the_last_look_and_the_publish_is_refused_not_overwritten(
    s3, tmp_path: Path, monkeypatch
) -> None:
    """upload_pack looked for a manifest at the URL (a HEAD), then put its own: a stranger's manifest put between
    the two was overwritten. On S3 the manifest's PUT carries If-None-Match: *, and the store's 412 refuses it."""
    options, fs = s3
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = _two_classes(tmp_path / "src", 7)
    url, key = "s3://packs/gap.lmdb", "gap.lmdb/manifest.json"
    put = _stranger_puts_first(monkeypatch, fs, key)
    with pytest.raises(ConfigError) as raised:
        packdata.convert(src, url, storage_options=options, shard_samples=5, progress=False)
    assert put == [key]
    assert str(raised.value) == changed_since_message(url)
    fs.invalidate_cache()
    assert fs.cat_file(f"packs/{key}") == STRANGER


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
