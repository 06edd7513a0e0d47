"""A conversion into (or from) object storage keeps its journals in a local work folder: only its own files there."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import packdata
from packdata.conversion.upload import work_folder
from packdata.errors import ConfigError


@pytest.mark.parametrize("journal", ["uploaded.jsonl", "replaced.jsonl", "downloaded.jsonl"])
def test_a_link_planted_for_a_work_folder_journal_is_refused_and_never_written_through(
    s3_store, image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: str
) -> None:
    """A journal beside the work folder was opened for append through whatever was at its name: with a shared
    PACKDATA_TMP, a symlink planted there had packdata append its journal lines to a file the planter chose."""
    options, fs = s3_store
    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    src = image_folder
    url, source = f"s3://packs/linked-{journal}.lmdb", src
    if journal == "replaced.jsonl":  # a pack there, replaced: its objects are recorded before its manifest goes
        packdata.convert(src, url, storage_options=options, progress=False)
    if journal == "downloaded.jsonl":  # a source folder at a URL, copied into its work folder first
        source = "s3://packs/source-folder"
        fs.put(str(src), source.removeprefix("s3://"), recursive=True)
        folder = work_folder(source, kind="source").parent
    else:
        folder = work_folder(url).parent
    folder.mkdir(parents=True, exist_ok=True)
    victim = tmp_path / "theirs.txt"
    victim.write_text("a file the planter chose\n")
    (folder / journal).symlink_to(victim)
    where = tmp_path / "out.lmdb" if journal == "downloaded.jsonl" else url
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(folder / journal))}: is a symlink, not a regular file: packdata never reads or "
        r"writes its own files through it \(another user may have put it there\)\. Remove it if it is not yours",
    ):
        packdata.convert(source, where, storage_options=options, overwrite=True, progress=False)
    assert victim.read_text() == "a file the planter chose\n"
    assert (folder / journal).is_symlink()


@pytest.mark.parametrize("planted", ["writable", "symlink"])
def test_an_upload_folder_in_packdata_tmp_others_may_write_in_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """Under PACKDATA_TMP the work folders' parent was used as found (unlike the default one in the temporary
    folder, checked): a folder there that others may write in let them plant links for packdata's journals."""
    shared, chosen = tmp_path / "shared", tmp_path / "chosen"
    shared.mkdir()
    chosen.mkdir()
    if planted == "symlink":
        (shared / "packdata-upload").symlink_to(chosen)
    else:
        (shared / "packdata-upload").mkdir()
        (shared / "packdata-upload").chmod(0o777)
    monkeypatch.setenv("PACKDATA_TMP", str(shared))
    problem = "a symlink, not a folder" if planted == "symlink" else "a folder others may write in"
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(shared / 'packdata-upload'))}: is {problem}: packdata keeps no files there "
        r"\(others could change them\)\. Remove it if it is not yours, or set PACKDATA_TMP",
    ):
        work_folder("s3://packs/new.lmdb")
    assert not any(chosen.iterdir())
    (shared / "packdata-upload").unlink() if planted == "symlink" else (shared / "packdata-upload").rmdir()
    made = work_folder("s3://packs/new.lmdb").parent.parent
    assert made == shared / "packdata-upload" and os.stat(made).st_mode & 0o777 == 0o700


def test_urls_that_differ_in_their_user_part_only_keep_their_work_apart(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work folders were keyed on the URL without its user part, yet fsspec reads memory://alice@packs/x at
    /alice@packs/x, another place than memory://packs/x: a conversion into one removed the other's interrupted
    work (and would have shared its journals), with no word."""
    import fsspec

    monkeypatch.setenv("PACKDATA_TMP", str(tmp_path / "work"))
    theirs, mine = "memory://alice:pw-9f3c@h-s3-packs/x.lmdb", "memory://h-s3-packs/x.lmdb"
    waiting = work_folder(theirs)
    assert waiting != work_folder(mine) and "alice" not in str(waiting) and "pw-9f3c" not in str(waiting)
    assert waiting == work_folder("memory://alice@h-s3-packs/x.lmdb")  # the password names no other place
    waiting.mkdir(parents=True)
    (waiting / "progress.json").write_text("{}")  # an interrupted conversion's, to resume
    try:
        packdata.convert(image_folder, mine, progress=False)
        assert fsspec.filesystem("memory").exists("/h-s3-packs/x.lmdb/manifest.json")
    finally:
        fsspec.filesystem("memory").rm("/h-s3-packs", recursive=True)
    assert (waiting / "progress.json").read_text() == "{}"
