"""Objects rewritten at an S3 URL while packdata works on them (a real moto server): named or kept, never mixed."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import faulty_s3

import packdata


def test_an_old_object_rewritten_after_the_overwrites_look_up_is_kept_not_deleted(
    s3_store, image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """remove_replaced looked the old pack's objects up, then deleted each unconditionally: an object another
    writer put at an old shard's name in between was deleted. On S3 the delete now carries If-Match."""
    from packdata.conversion import replace

    options, fs = s3_store
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url, root = "s3://packs/rewritten-before-delete.lmdb", "packs/rewritten-before-delete.lmdb"
    packdata.convert(image_folder, url, storage_options=options, shard_samples=6, progress=False)  # 4 shards
    assert fs.exists(f"{root}/shard-00003.lmdb/data.mdb")
    listing, calls = replace._listing, []

    def rewritten_after_the_look_up(store, where):
        found = listing(store, where)
        calls.append(where)
        if len(calls) == 2:  # remove_replaced's look-up (the first recorded the old pack)
            fs.pipe(f"{root}/shard-00003.lmdb/data.mdb", b"another writer's bytes")
        return found

    monkeypatch.setattr(replace, "_listing", rewritten_after_the_look_up)
    packdata.convert(image_folder, url, storage_options=options, overwrite=True, progress=False)  # one shard
    assert len(calls) == 2
    fs.invalidate_cache()
    assert fs.cat(f"{root}/shard-00003.lmdb/data.mdb") == b"another writer's bytes"
    assert not fs.exists(f"{root}/shard-00002.lmdb/data.mdb") and not fs.exists(f"{root}/shard-00001.lmdb")


def test_a_store_that_refuses_conditional_deletes_gets_a_plain_one(
    s3_store, image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that answers DELETE with If-Match by 501 NotImplemented still has the replaced pack's objects
    removed (after the look-up, as before conditional deletes)."""
    options, fs = s3_store
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    url, root = "s3://packs/no-conditional-delete.lmdb", "packs/no-conditional-delete.lmdb"
    packdata.convert(image_folder, url, storage_options=options, shard_samples=6, progress=False)  # 4 shards
    with faulty_s3(options) as (faulty, rules, hits):
        rules["DELETE", f"/{root}/shard-00003.lmdb/data.mdb"] = [501, 1]
        packdata.convert(image_folder, url, storage_options=faulty, overwrite=True, progress=False)
        assert hits["DELETE", f"/{root}/shard-00003.lmdb/data.mdb"] == 2  # refused, then plain
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/shard-00003.lmdb/data.mdb") and not fs.exists(f"{root}/shard-00001.lmdb")
