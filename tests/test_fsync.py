"""A file system that refuses fsync is named, with the file and what to do, wherever packdata makes a write durable.

Two real refusals: fsync of a folder on ``/proc`` (EINVAL, as some FUSE and special
file systems answer), and an ext4 volume on a loop device whose backing file lies
on a small tmpfs (thin provisioning: the volume says it has room, the disk below it
fills when the data is flushed, and fsync fails; mounted as root, skipped otherwise).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

import packdata
from packdata.pack.files import atomic_write, fsync_dir

_HINT = (
    "What was written there is not known to be on the disk: check that disk (a failing device, or a full volume "
    "beneath it: a thin, loop or network volume), or write to a local file system that supports fsync, then run again"
)


@pytest.fixture
def thin_ext4(tmp_path: Path, tmpfs, request: pytest.FixtureRequest) -> Path:
    """An ext4 file system of 64 MiB whose blocks lie in a sparse file on an 8 MiB tmpfs; unmounted afterwards.

    Without a journal, and mounted errors=continue: a journal aborts at the first of its writes the full disk
    beneath refuses, and the volume, read-only then, gave a later write (a lock's removal) an EROFS that
    replaced the error under test.
    """
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("needs mkfs.ext4")
    backing = tmpfs("8m", name="thin") / "backing"
    with open(backing, "wb") as f:
        f.truncate(64 << 20)
    options = "lazy_itable_init=1,lazy_journal_init=1"  # mkfs writes a few hundred KiB, not the whole volume
    subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", options, os.fspath(backing)], check=True)
    point = tmp_path / "ext4"
    point.mkdir()
    mount = ["mount", "-o", "loop,errors=continue", os.fspath(backing), os.fspath(point)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.decode().strip()}")
    # before the tmpfs; lazily: a file a failed test left open would keep it mounted
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", os.fspath(point)], check=False))
    return point


def test_fsync_of_a_folder_whose_file_system_refuses_it_names_the_folder() -> None:
    """fsync_dir (after every rename that publishes a pack, a manifest, a checkpoint) raised a bare
    OSError ('[Errno 22] Invalid argument') where the file system refuses fsync; it is now one ConfigError
    naming the folder, the refusal and what to do."""
    with pytest.raises(packdata.ConfigError) as caught:
        fsync_dir("/proc/self")
    assert str(caught.value) == (
        f"/proc/self: its file system refused to flush it to disk (fsync: Invalid argument). {_HINT}"
    )


def test_an_atomic_write_whose_flush_fills_the_disk_beneath_names_the_file_and_the_disk(thin_ext4: Path) -> None:
    """atomic_write (manifests, checkpoints, side tables) raised a bare OSError from fsync where the volume's
    data could not be flushed (the disk beneath it full); it is now a CapacityError naming the file and the
    mount, and neither the file nor its temporary is left."""
    target = thin_ext4 / "big.bin"
    with pytest.raises(packdata.CapacityError) as caught:
        atomic_write(target, os.urandom(16 << 20))  # room on the volume, not on the tmpfs beneath it
    pattern = (
        rf"{re.escape(str(thin_ext4))}/\.big\.bin\.tmp: no space left on {re.escape(str(thin_ext4))} \(ext4 of "
        rf"[0-9.]+ MiB, [0-9.]+ [KM]?i?B free\) while writing big\.bin \(flushing it to disk\)\. {re.escape(_HINT)}"
    )
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
    assert sorted(p.name for p in thin_ext4.iterdir()) == ["lost+found"]


def test_a_pack_writer_stopped_on_a_volume_that_refuses_fsync_raises_what_stopped_it(thin_ext4: Path) -> None:
    """A PackWriter that stops (a repeated key) closes its files: the sample index's flush, once a refused fsync
    became a PackdataError (the previous commit), replaced the error that stopped it, as closing after a failure
    must not. The repeated key is raised, and the partial pack is removed."""
    dst = thin_ext4 / "w.lmdb"
    # the volume's data cannot be flushed: the tmpfs beneath it is now full
    with pytest.raises(OSError), open(thin_ext4 / "filler", "wb") as f:
        f.write(os.urandom(16 << 20))
        os.fsync(f.fileno())
    repeated = r"key 'a' was written before \(sample 0\): keys are unique$"
    with pytest.raises(packdata.ConfigError, match=repeated), packdata.PackWriter(dst) as writer:
        writer.write({"__key__": "a", "txt": "first"})
        writer.write({"__key__": "a", "txt": "again"})
    assert not dst.exists() and not any(p.name.startswith(".w.lmdb") for p in thin_ext4.iterdir())


def _big_pack(folder: Path) -> Path:
    """An LMDB pack of one shard of 16 MiB of random bytes: more than the disk beneath the thin volume holds."""
    with packdata.PackWriter(folder / "big.lmdb") as writer:
        for i in range(4):
            writer.write({"__key__": f"k{i}", "bin": os.urandom(4 << 20)})
    return folder / "big.lmdb"


def test_a_downloaded_file_whose_flush_fills_the_disk_beneath_is_named_not_its_folder(
    thin_ext4: Path, tmp_path: Path, s3_store
) -> None:
    """A file a remote stage downloaded was made durable by a raw fsync: the full disk beneath the volume that
    refused it was named as the staged pack's folder ('while writing fsync-big.lmdb of the staged pack'), not the
    file. It is now the file, in the stage's words (the disk, the remote stage's hint)."""
    options, fs = s3_store
    fs.put(str(_big_pack(tmp_path)), "packs/fsync-big.lmdb", recursive=True)
    with pytest.raises(packdata.CapacityError) as caught:
        packdata.stage("s3://packs/fsync-big.lmdb", to=thin_ext4 / "cache", storage_options=options, progress=False)
    partial = thin_ext4 / "cache" / ".fsync-big.lmdb.partial"
    pattern = (
        rf"{re.escape(str(partial))}/shard-00000\.lmdb/\.data\.mdb\.part: no space left on "
        rf"{re.escape(str(thin_ext4))} \(ext4 of [0-9.]+ MiB, [0-9.]+ [KM]?i?B free\) while writing "
        r"shard-00000\.lmdb/data\.mdb of the staged pack\. A pack is staged whole from a URL: free space or stage "
        r"into another cache, then stage again \(what was downloaded is kept\)"
    )
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)


def test_a_staged_shard_whose_flush_fills_the_disk_beneath_is_named_in_the_stages_words(
    thin_ext4: Path, tmp_path: Path
) -> None:
    """A shard's copy is made durable through pack.files.fsync_named now (a refusal other than a full disk is
    a ConfigError naming the file); its full disk is still named in the stage's words: the shard, the volume and
    the stage's hint, not fsync_named's own."""
    with pytest.raises(packdata.CapacityError) as caught:
        packdata.stage(_big_pack(tmp_path), to=thin_ext4 / "staged", progress=False)
    pattern = (
        rf"{re.escape(str(thin_ext4 / 'staged' / 'big.lmdb'))}: no space left on {re.escape(str(thin_ext4))} "
        r"\(ext4 of [0-9.]+ MiB, [0-9.]+ [KM]?i?B free\) while staging shard 0 \(shard-00000\.lmdb, 16\.0 MiB\)\. "
        r"The partial copy was removed and the source is untouched\. Stage fewer shards with budget=SIZE, free "
        r"space, or use a larger tmpfs=SIZE"
    )
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)


_EXT4_IOC_SHUTDOWN, _NOLOGFLUSH = 0x8004587D, 2  # _IOR('X', 125, __u32); EXT4_GOING_FLAGS_NOLOGFLUSH


def test_an_lmdb_shard_refused_by_a_volume_with_room_is_no_capacity_error(thin_ext4: Path) -> None:
    """An LMDB commit refused where the disk has room (EIO from a failing device or a volume shut down) was a
    CapacityError, 'SHARD: cannot write the shard (mdb_txn_commit: Input/output error) on MOUNT (...)', as if
    the disk were full. It is now a ConfigError in LMDB's words that says the disk has room. The volume is
    really shut down (ext4's shutdown ioctl, as xfs_io -c shutdown): every write on it then gets EIO."""
    from packdata.formats.lmdb_writer import LMDBShardWriter
    from packdata.pack.records import Sample

    shard = thin_ext4 / "shard-00000.lmdb"
    writer = LMDBShardWriter(shard)
    writer.write([(0, Sample(key="k0", label=0, data=bytes(1000)))])
    fd = os.open(thin_ext4, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, _EXT4_IOC_SHUTDOWN, struct.pack("I", _NOLOGFLUSH))
    finally:
        os.close(fd)
    with pytest.raises(packdata.ConfigError) as caught:
        writer.write([(1, Sample(key="k1", label=0, data=bytes(100_000)))])
    pattern = (
        rf"{re.escape(str(shard))}: cannot write the shard \(LMDB: mdb_txn_commit: Input/output error\) on "
        rf"{re.escape(str(thin_ext4))} \(ext4 of [0-9.]+ MiB, [0-9.]+ MiB free\), which has room for it\. Check that "
        r"disk \(a failing device, a volume shut down or turned read-only\), or write to another file system, then "
        r"run again \(a conversion: resume=True continues it\)"
    )
    assert re.fullmatch(pattern, str(caught.value)), str(caught.value)
    assert not isinstance(caught.value, packdata.CapacityError)
