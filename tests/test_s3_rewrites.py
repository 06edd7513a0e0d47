"""Objects rewritten at an S3 URL while packdata works on them (a real moto server): named or kept, never mixed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import faulty_s3
from faults.hostile import rewrite_manifest

import packdata
from packdata.errors import PackFormatError


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


def _older_pack(image_folder: Path, tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A TFRecord pack whose manifest has no index digests (an older packdata's), and its sizes.i64."""
    older = tmp_path / "older"
    packdata.convert(image_folder, older, format="tfrecord", shard_samples=6, progress=False)
    rewrite_manifest(older, lambda d: d["index"].pop("sha256"))
    return older, np.fromfile(older / "index" / "sizes.i64", dtype="<i8")


_REWRITTEN = (
    r"was rewritten or removed while the pack's index and side tables were copied \(the pack at the URL changed\)"
)


def test_an_index_file_rewritten_on_s3_while_a_cache_copies_it_is_named_never_cached_mixed(
    s3_store, image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On S3 each skeleton file was pinned to its ETag only when opened: an older pack (no index digests) whose
    sizes.i64 was rewritten after the first file's copy began was cached with the new sizes.i64 under the old
    manifest, silently. Every file's ETag is now looked up first, and each read carries it (If-Match)."""
    from packdata.formats import remote_pack

    options, fs = s3_store
    older, sizes = _older_pack(image_folder, tmp_path)
    url, root = "s3://packs/older-rewritten-mid-copy", "packs/older-rewritten-mid-copy"
    fs.put(str(older), root, recursive=True)
    copy_within = remote_pack._copy_within

    def rewritten_after_the_look_up(*args, **kwargs):  # while the first file is copied
        fs.pipe(f"{root}/index/sizes.i64", (sizes + 1).astype("<i8").tobytes())
        return copy_within(*args, **kwargs)

    monkeypatch.setattr(remote_pack, "_copy_within", rewritten_after_the_look_up)
    cache = tmp_path / "cache"
    with pytest.raises(PackFormatError, match=rf"^{url}/index/sizes\.i64: {_REWRITTEN}: nothing was cached from it"):
        packdata.TFRecordDataset(url, decode="bytes", cache_dir=cache, storage_options=options)
    assert not list(cache.rglob("manifest.json")) and not list(cache.rglob(".files.json"))


@contextlib.contextmanager
def _uploaded_again_at_the_first_look_up(
    s3_store, image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str, module: Any, name: str
) -> Iterator[tuple[str, dict[str, Any]]]:
    """An older pack (no index digests) at ``store://packs/NAME``, uploaded again (a new sizes.i64, then a new
    manifest) when ``module``'s first ``remote_object`` look-up begins; yields (its URL, storage options), then
    removes it."""
    import fsspec

    options, fs = s3_store
    older, sizes = _older_pack(image_folder, tmp_path)
    if store == "memory":
        options, fs = {}, fsspec.filesystem("memory")
    url, root = f"{store}://packs/{name}", f"packs/{name}"
    fs.put(str(older), root, recursive=True)
    rewrite_manifest(older, lambda d: d.update(source="another source"))  # the pack converted and uploaded again
    (older / "index" / "sizes.i64").write_bytes((sizes + 1).astype("<i8").tobytes())
    looked_up = module.remote_object

    def uploaded_again_before_the_look_ups(store_fs, path, where):
        if not fs.exists(f"{root}/.uploaded-again"):
            fs.pipe(f"{root}/.uploaded-again", b"")
            for rel in ("index/sizes.i64", "manifest.json"):  # --overwrite: the manifest goes up last
                fs.pipe(f"{root}/{rel}", (older / rel).read_bytes())
            fs.invalidate_cache()
        return looked_up(store_fs, path, where)

    monkeypatch.setattr(module, "remote_object", uploaded_again_before_the_look_ups)
    try:
        yield url, options
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize("store", ["s3", "memory"])
def test_a_pack_uploaded_again_between_its_manifest_read_and_the_look_ups_is_named(
    s3_store, image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """The skeleton's files were looked up after its manifest was read: an older pack (no index digests) uploaded
    again in between had its new sizes.i64 looked up, read and cached under the old manifest, silently."""
    from packdata.formats import remote_pack

    cache = tmp_path / "cache"
    with (
        _uploaded_again_at_the_first_look_up(
            s3_store, image_folder, tmp_path, monkeypatch, store, remote_pack, "uploaded-again-h-s3"
        ) as (url, options),
        pytest.raises(PackFormatError, match=rf"^{url}/manifest\.json: {_REWRITTEN}: nothing was cached"),
    ):
        packdata.TFRecordDataset(url, decode="bytes", cache_dir=cache, storage_options=options)
    assert not list(cache.rglob("manifest.json")) and not list(cache.rglob(".files.json"))


@pytest.mark.parametrize("store", ["s3", "memory"])
def test_a_pack_uploaded_again_between_its_manifest_read_and_a_stages_look_ups_is_named(
    s3_store, image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store: str
) -> None:
    """A stage from a URL looked up the files its manifest gives no size (an older pack's index files) after it
    read the manifest: a pack uploaded again in between was staged, its new sizes.i64 under the old manifest."""
    from packdata.staging import remote

    with (
        _uploaded_again_at_the_first_look_up(
            s3_store, image_folder, tmp_path, monkeypatch, store, remote, "staged-uploaded-again-h-s3"
        ) as (url, options),
        pytest.raises(
            PackFormatError,
            match=rf"^{url}/manifest\.json: was rewritten or removed \(the pack at the URL changed while staging\): "
            r"nothing was staged from it",
        ),
    ):
        packdata.stage(url, to=tmp_path / "cache", storage_options=options, progress=False)
    assert not (tmp_path / "cache" / "staged-uploaded-again-h-s3").exists()
