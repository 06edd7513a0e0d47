"""Packs a stranger hands over, with files made to hang, crash or lead out of the pack: each is named, never read
through, never waited on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from packdata import LMDBDataset, PackFormatError, convert
from packdata.pack.manifest.schema import MAX_MANIFEST_BYTES


def _pack_and_more(tmp: Path) -> tuple[Path, Path]:
    """A pack of 4 texts (t0..t3) and a folder of 2 more (t4, t5) to append."""
    src, more = tmp / "src", tmp / "more"
    src.mkdir()
    more.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    for i in range(4, 6):
        (more / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    pack = tmp / "out.lmdb"
    convert(src, pack, progress=False)
    return pack, more


def _refused_then_appended(pack: Path, more: Path, said: str) -> None:
    """An append resumed over the planted plan is refused with ``PLAN: {said}then append again without resume``;
    the pack keeps its 4 samples, and an append without resume adds ``more``'s 2."""
    with pytest.raises(PackFormatError) as raised:
        convert(more, pack, progress=False, append=True, resume=True)
    assert str(raised.value) == f"{pack / '.append-a1.json'}: {said}then append again without resume"
    assert len(LMDBDataset(pack)) == 4
    convert(more, pack, progress=False, append=True)
    assert [s[0] for s in LMDBDataset(pack)] == [f"t{i}" for i in range(6)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("plan", ["fifo", "nested", "link"])
def test_an_append_plan_that_is_a_fifo_nested_json_or_a_link_is_named_never_waited_on(
    tmp_path: Path, plan: str
) -> None:
    """A pack holding ``.append-a1.json`` (the plan an interrupted append leaves) as a FIFO hung ``convert ...
    --append --resume`` for ever (the plan was read with a plain open); one of ``[[[[...`` (100,000 deep) stopped it
    with a bare RecursionError; a link to a plan outside the pack was read through. Each is now named as an
    unreadable plan, with the remedy; the pack is untouched, and an append without resume goes on."""
    pack, more = _pack_and_more(tmp_path)
    journal = pack / ".append-a1.json"
    if plan == "fifo":
        os.mkfifo(journal)
        why = f"[Errno 22] not a regular file: a FIFO: '{journal}'"
    elif plan == "nested":
        journal.write_text("[" * 100_000, encoding="utf-8")
        why = "maximum recursion depth exceeded while decoding a JSON array from a unicode string"
    else:
        outside = tmp_path / "plan.json"
        outside.write_text("{}", encoding="utf-8")
        journal.symlink_to(outside)
        why = f"[Errno 40] Too many levels of symbolic links: '{journal}'"
    _refused_then_appended(
        pack, more, f"the plan of an interrupted append is unreadable ({why}). Remove .append-a1.json from the pack, "
    )


@pytest.mark.timeout(60)
def test_an_append_plan_longer_than_packdata_writes_is_named_never_read(tmp_path: Path) -> None:
    """A pack holding ``.append-a1.json`` (the plan an interrupted append leaves) of 1 GiB and a byte, more than a
    plan of two manifests at their longest and its moves can be, was read whole (a 10 GB file too) before it was
    found not JSON. It is now refused by its size, never read, naming it with the remedy; the pack is untouched,
    and an append without resume goes on."""
    pack, more = _pack_and_more(tmp_path)
    journal = pack / ".append-a1.json"
    most = 4 * MAX_MANIFEST_BYTES
    with open(journal, "wb") as f:
        f.truncate(most + 1)  # sparse: no disk taken
    _refused_then_appended(
        pack,
        more,
        f"the plan of an interrupted append is {most + 1} bytes, more than the {most} packdata writes at "
        "most. Remove .append-a1.json from the pack, ",
    )


def test_a_cached_copys_record_of_deeply_nested_json_is_downloaded_again(tmp_path: Path) -> None:
    """The cache's record of the files a URL pack's cached copy holds (.files.json) holding ``[[[[...`` (100,000
    deep) stopped every reader of that URL with a bare RecursionError: the copy is now not reused, and a fresh one
    is downloaded, as for any record that is not JSON."""
    import fsspec

    from packdata import TFRecordDataset

    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    convert(src, tmp_path / "pack", format="tfrecord", progress=False)
    memory = fsspec.filesystem("memory")
    memory.put(str(tmp_path / "pack"), "/hostile/nested", recursive=True)
    cache = tmp_path / "cache"
    try:
        ds = TFRecordDataset("memory://hostile/nested", decode="bytes", shuffle=False, cache_dir=cache)
        assert [data for data, _ in ds] == [f"t{i}".encode() for i in range(4)]
        (record,) = cache.rglob(".files.json")
        record.write_text("[" * 100_000, encoding="utf-8")
        again = TFRecordDataset("memory://hostile/nested", decode="bytes", shuffle=False, cache_dir=cache)
        assert [data for data, _ in again] == [f"t{i}".encode() for i in range(4)]
        (record,) = cache.rglob(".files.json")
        assert record.read_bytes().startswith(b"{")
    finally:
        memory.rm("/hostile", recursive=True)


@pytest.mark.parametrize("rerun", ["again", "resume"])
@pytest.mark.parametrize("stopped", ["took_effect", "planned"])
def test_an_append_folder_that_is_a_link_is_refused_nothing_moved_out_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stopped: str, rerun: str
) -> None:
    """A pack whose interrupted append's folder (.append-a1.partial) is a link to a folder outside: finishing the
    append moved that folder's skipped.jsonl into the pack (taken from outside, the pack's skip report replaced),
    then stopped on a bare OSError ('Cannot call rmtree on a symbolic link') on every run; resuming one not yet
    taken effect moved the outside folder's index in as the pack's. It is now refused, named, before anything is
    read or moved through it (an append not taken effect and not resumed is undone, the link itself removed, as
    before); what is outside stays as it was."""
    from packdata.conversion import append

    src, more, again = tmp_path / "src", tmp_path / "more", tmp_path / "again"
    for folder, numbers in ((src, range(4)), (more, range(4, 6)), (again, range(6, 7))):
        folder.mkdir()
        for i in numbers:
            (folder / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    pack = tmp_path / "out.lmdb"
    convert(src, pack, progress=False)
    step = "_finish" if stopped == "took_effect" else "write_manifest"
    real = getattr(append, step)

    def interrupted(*args: object, **kwargs: object) -> None:
        monkeypatch.setattr(append, step, real)
        raise KeyboardInterrupt  # Ctrl-C before the append's folder is taken

    monkeypatch.setattr(append, step, interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(more, pack, progress=False, append=True)
    staging = pack / ".append-a1.partial"
    assert staging.is_dir() and (pack / ".append-a1.json").is_file()
    shutil.rmtree(staging)
    outside = tmp_path / "outside"
    (outside / "index").mkdir(parents=True)
    (outside / "index" / "keys.utf8").write_text("not the pack's", encoding="utf-8")
    (outside / "skipped.jsonl").write_text("not the pack's\n", encoding="utf-8")
    before = {p.relative_to(outside): p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    staging.symlink_to(outside)
    if (stopped, rerun) == ("planned", "again"):  # an append that never took effect is undone: the link itself goes
        convert(again, pack, progress=False, append=True)
    else:
        with pytest.raises(PackFormatError) as raised:
            convert(again if rerun == "again" else more, pack, progress=False, append=True, resume=rerun == "resume")
        assert str(raised.value) == (
            f"{staging}: the interrupted append's folder is a link or a file, not the folder packdata made: nothing "
            "is read or moved through it. Remove it from the pack (a link: only the link itself), then run the "
            "append again"
        )
        staging.unlink()
        convert(again, pack, progress=False, append=True)
    assert {p.relative_to(outside): p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
    assert b"not the pack's" not in (pack / "skipped.jsonl").read_bytes()
    expected = [f"t{i}" for i in range(7)] if stopped == "took_effect" else [f"t{i}" for i in (0, 1, 2, 3, 6)]
    assert [s[0] for s in LMDBDataset(pack)] == expected


def test_an_append_resumed_through_a_linked_sibling_never_moves_another_packs_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``convert SRC PACK --append`` converts SRC into ``.PACK.append`` beside the pack, then moves its shards in.
    Interrupted there, and that folder swapped for a link to another pack (the user's ``other.lmdb``), ``--append
    --resume`` moved the other pack's shard files into PACK (the other pack left without its data, its samples
    now PACK's), then stopped on a bare OSError ('Cannot call rmtree on a symbolic link'). A link there is now
    refused, named, before anything moves; the other pack reads as before."""
    import packdata.conversion.convert as convert_module

    src, more, other_src = tmp_path / "src", tmp_path / "more", tmp_path / "other_src"
    for folder, numbers in ((src, range(4)), (more, range(4, 6)), (other_src, range(10, 14))):
        folder.mkdir()
        for i in numbers:
            (folder / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    pack, other = tmp_path / "out.lmdb", tmp_path / "other.lmdb"
    convert(src, pack, progress=False)
    convert(other_src, other, progress=False)
    real = convert_module.append_pack

    def interrupted(*args: object, **kwargs: object) -> None:
        monkeypatch.setattr(convert_module, "append_pack", real)
        raise KeyboardInterrupt  # Ctrl-C once the new samples are converted beside the pack

    monkeypatch.setattr(convert_module, "append_pack", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(more, pack, progress=False, append=True)
    extra = tmp_path / ".out.lmdb.append"
    shutil.rmtree(extra)
    extra.symlink_to(other)
    with pytest.raises(PackFormatError) as raised:
        convert(more, pack, progress=False, append=True, resume=True)
    assert str(raised.value) == (
        f"{extra}: the pack to append is a link or a file, not the folder packdata converted: nothing is moved out "
        "of it. Remove it (a link: only the link itself), then append again without resume"
    )
    assert [s[0] for s in LMDBDataset(other)] == [f"t{i}" for i in range(10, 14)]
    assert [s[0] for s in LMDBDataset(pack)] == [f"t{i}" for i in range(4)]
    convert(more, pack, progress=False, append=True)  # without resume: the link itself goes, SRC converted again
    assert [s[0] for s in LMDBDataset(pack)] == [f"t{i}" for i in range(6)]
    assert [s[0] for s in LMDBDataset(other)] == [f"t{i}" for i in range(10, 14)]
