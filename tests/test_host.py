"""Tests of packdata.host: crafted /proc and /sys trees under tmp_path, plus the real machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from packdata.host import facts as host_facts
from packdata.host import gpus as host_gpus
from packdata.host.facts import (
    CgroupMemory,
    MemoryInfo,
    Mount,
    SystemFacts,
    find_mount,
    gather_facts,
    is_network_fs,
    is_rotational,
    read_cgroup_memory,
    read_cgroup_memory_limit,
    read_meminfo,
    read_mounts,
    tmpfs_usage,
)
from packdata.host.gpus import GPUInfo
from packdata.host.memory import DEFAULT_RESERVE_MIN, SafetyWarning, default_reserve, memory_warnings, safe_tmpfs_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
V1_UNLIMITED = "9223372036854771712"

MEMINFO = """\
MemTotal:       65536000 kB
MemFree:         1000000 kB
MemAvailable:   60000000 kB
Buffers:          200000 kB
Cached:          3000000 kB
SwapCached:            0 kB
SwapTotal:       8388604 kB
SwapFree:        8000000 kB
Shmem:            123456 kB
HugePages_Total:       0
"""


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def facts(
    total: int = 64 * GiB,
    available: int = 60 * GiB,
    swap_total: int = 0,
    swap_free: int = 0,
    limit: int | None = None,
    usage: int | None = None,
) -> SystemFacts:
    return SystemFacts(MemoryInfo(total, available, swap_total, swap_free), CgroupMemory(limit, usage))


def codes(warnings: list[SafetyWarning]) -> list[str]:
    return [w.code for w in warnings]


# --------------------------------------------------------------------------- /proc/meminfo


def test_read_meminfo_parses_bytes(tmp_path: Path) -> None:
    write(tmp_path, "proc/meminfo", MEMINFO)
    mem = read_meminfo(tmp_path)
    assert mem.mem_total == 65536000 * KiB
    assert mem.mem_available == 60000000 * KiB
    assert (mem.swap_total, mem.swap_free) == (8388604 * KiB, 8000000 * KiB)
    assert mem.swap_used == (8388604 - 8000000) * KiB
    assert (mem.shmem, mem.cached) == (123456 * KiB, 3000000 * KiB)


def test_read_meminfo_without_memavailable_estimates_it(tmp_path: Path) -> None:
    write(tmp_path, "proc/meminfo", "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 20 kB\nCached: 300 kB\n")
    mem = read_meminfo(str(tmp_path))
    assert mem.mem_available == 420 * KiB
    assert mem.swap_total == 0 and mem.swap_used == 0


def test_read_meminfo_errors(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        read_meminfo(tmp_path)
    write(tmp_path, "proc/meminfo", "MemFree: 100 kB\n")
    with pytest.raises(ValueError, match="no MemTotal"):
        read_meminfo(tmp_path)


# --------------------------------------------------------------------------- cgroups


def test_cgroup_v2_nested_limits_take_the_smallest(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    base = "sys/fs/cgroup"
    write(tmp_path, f"{base}/kubepods/memory.max", "max\n")
    write(tmp_path, f"{base}/kubepods/memory.current", str(50 * GiB))
    write(tmp_path, f"{base}/kubepods/pod1/memory.max", str(8 * GiB))
    write(tmp_path, f"{base}/kubepods/pod1/memory.current", str(3 * GiB))
    write(tmp_path, f"{base}/kubepods/pod1/memory.stat", f"anon 100\ninactive_file {GiB}\nactive_file 5\n")
    write(tmp_path, f"{base}/kubepods/pod1/ctr/memory.max", str(16 * GiB))
    write(tmp_path, f"{base}/kubepods/pod1/ctr/memory.current", str(2 * GiB))
    cg = read_cgroup_memory(tmp_path)
    assert cg == CgroupMemory(limit=8 * GiB, usage=3 * GiB, version=2, inactive_file=GiB)
    assert cg.headroom == 8 * GiB - (3 * GiB - GiB)
    assert read_cgroup_memory_limit(tmp_path) == 8 * GiB


def test_cgroup_v2_memory_high_is_a_limit_too(tmp_path: Path) -> None:
    """memory.high was not read: with memory.max at 16 GiB and memory.high at 6 GiB, a 10 GiB tmpfs passed the
    checks, and the cgroup is throttled at 6 GiB (tmpfs pages cannot be reclaimed without swap)."""
    write(tmp_path, "proc/self/cgroup", "0::/job/ctr\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.max", str(16 * GiB))
    write(tmp_path, "sys/fs/cgroup/job/memory.high", "max\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.current", str(GiB))
    write(tmp_path, "sys/fs/cgroup/job/ctr/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/job/ctr/memory.high", str(6 * GiB))
    write(tmp_path, "sys/fs/cgroup/job/ctr/memory.current", str(GiB))
    write(tmp_path, "proc/meminfo", MEMINFO)  # 57 GiB available on the host
    found = gather_facts(tmp_path, include_gpus=False)
    assert found.cgroup == CgroupMemory(limit=6 * GiB, usage=GiB, version=2)
    refused = [w for w in memory_warnings(found, tmpfs_size=10 * GiB, reserve=0) if w.severity == "refuse"]
    assert [w.code for w in refused] == ["tmpfs-too-large"] and "5.0 GiB is available" in refused[0].message


def test_cgroup_v2_max_means_no_limit(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "0::/user.slice/session\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/session/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/user.slice/session/memory.current", "12345\n")
    cg = read_cgroup_memory(tmp_path)
    assert cg == CgroupMemory(limit=None, usage=12345, version=2)
    assert cg.headroom is None
    assert read_cgroup_memory_limit(tmp_path) is None


def test_cgroup_v2_namespace_falls_back_to_the_mount_root(tmp_path: Path) -> None:
    # Inside a cgroup namespace the listed path does not exist under the mount; its root is the container.
    write(tmp_path, "proc/self/cgroup", "0::/../../system.slice/docker-abc.scope\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", str(4 * GiB))
    write(tmp_path, "sys/fs/cgroup/memory.current", str(GiB))
    assert read_cgroup_memory(tmp_path) == CgroupMemory(4 * GiB, GiB, 2)


def test_cgroup_v1_limit_and_huge_value_means_none(tmp_path: Path) -> None:
    text = "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n"
    base = tmp_path / "sys/fs/cgroup/memory"
    write(base, "memory.limit_in_bytes", V1_UNLIMITED)
    write(base, "memory.usage_in_bytes", str(40 * GiB))
    write(base, "docker/abc/memory.limit_in_bytes", V1_UNLIMITED)
    write(base, "docker/abc/memory.usage_in_bytes", str(GiB))
    # Hybrid layout: the 0:: line exists but v2 has no memory files, so v1 answers.
    assert read_cgroup_memory(tmp_path, proc_self_cgroup=text) == CgroupMemory(None, GiB, 1)
    write(base, "docker/memory.limit_in_bytes", str(2 * GiB))
    write(base, "docker/memory.usage_in_bytes", str(GiB + 5))
    write(base, "docker/memory.stat", "cache 9\ntotal_inactive_file 7\n")
    assert read_cgroup_memory(tmp_path, proc_self_cgroup=text) == CgroupMemory(2 * GiB, GiB + 5, 1, 7)
    assert read_cgroup_memory_limit(tmp_path, text) == 2 * GiB


def test_cgroup_v1_controller_list_with_memory(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/cgroup", "3:cpu,memory:/job\n")
    write(tmp_path, "sys/fs/cgroup/memory/job/memory.limit_in_bytes", "1073741824\n")
    assert read_cgroup_memory_limit(tmp_path) == GiB


def test_no_cgroup_files_means_unknown(tmp_path: Path) -> None:
    assert read_cgroup_memory(tmp_path) == CgroupMemory(None, None, None)
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    assert read_cgroup_memory(tmp_path) == CgroupMemory(None, None, None)


# --------------------------------------------------------------------------- mounts and disks


MOUNTS = r"""proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
/dev/nvme0n1p2 / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=32G 0 0
server:/export /mnt/my\040data nfs4 rw,vers=4.2,hard 0 0
/dev/sdb1 /mnt/tab\011and\134slash xfs ro 0 0
/dev/sdc1 /mnt/a ext4 rw 0 0
/dev/sdd1 /mnt/ab ext4 rw 0 0
"""


def test_read_mounts_decodes_octal_escapes(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/mounts", MOUNTS)
    mounts = read_mounts(tmp_path)
    assert len(mounts) == 7
    assert mounts[3] == Mount("server:/export", "/mnt/my data", "nfs4", ("rw", "vers=4.2", "hard"))
    assert mounts[4].mountpoint == "/mnt/tab\tand\\slash"
    assert mounts[2].options[-1] == "size=32G"


def test_read_mounts_falls_back_to_proc_mounts_and_empty(tmp_path: Path) -> None:
    assert read_mounts(tmp_path) == []
    write(tmp_path, "proc/mounts", "tmpfs /run tmpfs rw 0 0\n")
    assert read_mounts(tmp_path) == [Mount("tmpfs", "/run", "tmpfs", ("rw",))]


def test_find_mount_longest_prefix_on_component_boundaries(tmp_path: Path) -> None:
    write(tmp_path, "proc/self/mounts", MOUNTS)
    mounts = read_mounts(tmp_path)
    assert find_mount("/mnt/a/x/y", mounts).device == "/dev/sdc1"
    assert find_mount("/mnt/ab", mounts).device == "/dev/sdd1"
    assert find_mount("/mnt/abc", mounts).mountpoint == "/"
    assert find_mount("/mnt/my data/train.lmdb", mounts).fstype == "nfs4"
    assert find_mount("/", mounts).device == "/dev/nvme0n1p2"


def test_find_mount_stacked_and_missing(tmp_path: Path) -> None:
    real = os.path.realpath(tmp_path)
    stacked = [Mount("a", "/", "ext4"), Mount("b", real, "ext4"), Mount("c", real + "/", "tmpfs")]
    assert find_mount(tmp_path / "x", stacked).device == "c"
    with pytest.raises(LookupError, match="no mount"):
        find_mount(tmp_path, [Mount("b", "/elsewhere", "ext4")])


@pytest.mark.parametrize(
    ("fstype", "expected"),
    [
        ("nfs", True),
        ("NFS4", True),
        ("cifs", True),
        ("smb3", True),
        ("fuse.sshfs", True),
        ("fuse.gcsfuse", True),
        ("lustre", True),
        ("gpfs", True),
        ("ceph", True),
        ("glusterfs", True),
        ("9p", True),
        ("beegfs", True),
        ("ext4", False),
        ("xfs", False),
        ("tmpfs", False),
        ("overlay", False),
        ("fuseblk", False),
    ],
)
def test_is_network_fs(fstype: str, expected: bool) -> None:
    assert is_network_fs(fstype) is expected


def _devnum(path: Path) -> str:
    dev = os.stat(path).st_dev
    return f"{os.major(dev)}:{os.minor(dev)}"


def test_is_rotational_whole_disk(tmp_path: Path) -> None:
    sysroot = tmp_path / "root"
    write(sysroot, f"sys/dev/block/{_devnum(tmp_path)}/queue/rotational", "1\n")
    assert is_rotational(tmp_path, root=sysroot) is True
    write(sysroot, f"sys/dev/block/{_devnum(tmp_path)}/queue/rotational", "0\n")
    assert is_rotational(tmp_path / "not" / "yet", root=sysroot) is False


def test_is_rotational_partition_resolves_to_parent(tmp_path: Path) -> None:
    sysroot = tmp_path / "root"
    disk = sysroot / "sys/devices/pci0/block/sda"
    write(disk, "queue/rotational", "1\n")
    write(disk, "sda1/partition", "1\n")
    link = sysroot / f"sys/dev/block/{_devnum(tmp_path)}"
    link.parent.mkdir(parents=True)
    link.symlink_to(Path("../../devices/pci0/block/sda/sda1"))
    assert is_rotational(tmp_path, root=sysroot) is True


def test_is_rotational_unknown_is_none(tmp_path: Path) -> None:
    assert is_rotational(tmp_path, root=tmp_path / "empty") is None


def test_tmpfs_usage_measures_reachable_tmpfs_and_skips_the_rest(tmp_path: Path) -> None:
    real_dir = tmp_path / "staging area"
    real_dir.mkdir()
    escaped = str(real_dir).replace(" ", "\\040")
    text = f"tmpfs {escaped} tmpfs rw 0 0\ntmpfs /no/such/tmpfs tmpfs rw 0 0\n/dev/sda1 {tmp_path} ext4 rw 0 0\n"
    write(tmp_path, "proc/self/mounts", text)
    [usage] = tmpfs_usage(tmp_path)
    assert usage.mountpoint == str(real_dir)
    assert usage.size_bytes > 0 and 0 <= usage.used_bytes <= usage.size_bytes
    assert tmpfs_usage(tmp_path / "empty") == []


def test_disk_free_uses_nearest_existing_parent(tmp_path: Path) -> None:
    free = host_facts.disk_free(tmp_path / "a" / "b" / "c.lmdb")
    assert isinstance(free, int) and free > 0


# --------------------------------------------------------------------------- CPUs and GPUs


def test_cpu_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    physical, logical = host_facts.cpu_counts()
    assert physical >= 1 and logical >= 1
    monkeypatch.setattr(host_facts.psutil, "cpu_count", lambda logical=True: 8 if logical else None)
    assert host_facts.cpu_counts() == (8, 8)


def test_gpus_returns_a_list_without_raising() -> None:
    found = host_gpus.gpus()
    assert isinstance(found, list)
    assert all(isinstance(g, GPUInfo) and g.total_bytes >= g.free_bytes >= 0 for g in found)


def test_gpus_through_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    mem = types.SimpleNamespace(total=80 * GiB, free=70 * GiB)

    def utilization(handle: int) -> types.SimpleNamespace:
        if handle == 1:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")  # a MIG slice, for one
        return types.SimpleNamespace(gpu=37)

    fake = types.SimpleNamespace(
        nvmlDeviceGetUtilizationRates=utilization,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H100" if h == 0 else "NVIDIA A100",
        nvmlDeviceGetMemoryInfo=lambda h: mem,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert host_gpus.gpus() == [
        GPUInfo(0, "NVIDIA H100", 80 * GiB, 70 * GiB, 0.37),
        GPUInfo(1, "NVIDIA A100", 80 * GiB, 70 * GiB, None),
    ]


def test_gpus_never_raise_when_every_probe_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise RuntimeError("driver gone")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=boom))
    monkeypatch.setattr(host_gpus, "_gpus_torch", boom)
    assert host_gpus.gpus() == []


# --------------------------------------------------------------------------- facts


def test_gather_facts_on_the_real_machine(tmp_path: Path) -> None:
    found = gather_facts(path=tmp_path / "staged")
    assert found.memory.mem_total > 0
    assert 0 <= found.memory.mem_available <= found.memory.mem_total
    assert found.cpu_logical >= 1 and found.cpu_physical >= 1
    assert isinstance(found.gpus, list)
    assert found.path == str(tmp_path / "staged")
    assert found.path_free is not None and found.path_free > 0
    assert found.path_mount is not None and found.path_network is not None
    data = json.loads(json.dumps(found.to_dict()))
    assert data["memory"]["mem_total"] == found.memory.mem_total


def test_gather_facts_on_a_crafted_root(tmp_path: Path) -> None:
    write(tmp_path, "proc/meminfo", MEMINFO)
    write(tmp_path, "proc/self/cgroup", "0::/job\n")
    write(tmp_path, "sys/fs/cgroup/job/memory.max", str(16 * GiB))
    write(tmp_path, "sys/fs/cgroup/job/memory.current", str(GiB))
    found = gather_facts(tmp_path, include_gpus=False)
    assert found.memory.mem_total == 65536000 * KiB
    assert found.cgroup == CgroupMemory(16 * GiB, GiB, 2)
    assert found.gpus == [] and found.path is None and found.tmpfs == []
    assert "cgroup-limit" in codes(memory_warnings(found))


# --------------------------------------------------------------------------- warnings


def test_healthy_machine_gives_no_warnings() -> None:
    assert memory_warnings(facts()) == []
    assert codes(memory_warnings(facts(), tmpfs_size=16 * GiB)) == ["tmpfs-volatile"]
    assert memory_warnings(facts(), tmpfs_size=16 * GiB)[0].severity == "warn"
    # A cgroup limit above MemTotal, and swap that is present but unused without a tmpfs, are fine too.
    assert memory_warnings(facts(swap_total=8 * GiB, swap_free=8 * GiB, limit=128 * GiB, usage=GiB)) == []


def test_tmpfs_too_large_refuses_with_an_actionable_message() -> None:
    healthy = facts()  # 60 GiB available, default reserve 6.4 GiB
    assert safe_tmpfs_size(healthy) == 60 * GiB - int(64 * GiB * 0.10)
    [refusal, volatile] = memory_warnings(healthy, tmpfs_size=58 * GiB)
    assert (refusal.code, refusal.severity) == ("tmpfs-too-large", "refuse")
    assert "58.0 GiB" in refusal.message and "ask for at most 53.6 GiB" in refusal.message
    assert volatile.code == "tmpfs-volatile"
    assert codes(memory_warnings(healthy, tmpfs_size=50 * GiB)) == ["tmpfs-volatile"]
    assert codes(memory_warnings(healthy, tmpfs_size=50 * GiB, reserve=20 * GiB))[0] == "tmpfs-too-large"


def test_tmpfs_too_large_uses_cgroup_headroom() -> None:
    limited = facts(limit=16 * GiB, usage=10 * GiB)  # 6 GiB headroom; reserve min(4 GiB, 8 GiB) = 4 GiB
    assert default_reserve(limited) == 4 * GiB
    assert safe_tmpfs_size(limited) == 2 * GiB
    assert codes(memory_warnings(limited, tmpfs_size=3 * GiB)) == ["tmpfs-too-large", "cgroup-limit", "tmpfs-volatile"]
    assert "tmpfs-too-large" not in codes(memory_warnings(limited, tmpfs_size=2 * GiB))


def test_default_reserve_rules() -> None:
    assert default_reserve(facts(total=16 * GiB)) == DEFAULT_RESERVE_MIN
    assert default_reserve(facts(total=1 * TiB)) == int(TiB * 0.10)
    assert default_reserve(facts(total=6 * GiB, available=5 * GiB)) == 3 * GiB  # capped at half
    assert safe_tmpfs_size(facts(total=4 * GiB, available=GiB)) == 0  # never negative
    assert safe_tmpfs_size(facts(), reserve=0) == 60 * GiB


def test_swap_on_tmpfs() -> None:
    swappy = facts(swap_total=8 * GiB, swap_free=8 * GiB)
    assert "swap-on-tmpfs" not in codes(memory_warnings(swappy))
    found = [w for w in memory_warnings(swappy, tmpfs_size=GiB) if w.code == "swap-on-tmpfs"]
    assert len(found) == 1 and "swapoff" in found[0].message and found[0].severity == "warn"


@pytest.mark.parametrize(
    ("available", "swap_free", "fires"),
    [
        (5 * GiB, 7 * GiB, True),  # under 10% of MemTotal available and swap in use
        (20 * GiB, 0, False),  # 20 GiB available, 8 GiB of swap in use: not yet near
        (6 * GiB, 0, True),  # less available than swap in use
        (5 * GiB, 8 * GiB, False),  # low memory but no swap in use yet
    ],
)
def test_oom_near(available: int, swap_free: int, fires: bool) -> None:
    found = codes(memory_warnings(facts(available=available, swap_total=8 * GiB, swap_free=swap_free)))
    assert ("oom-near" in found) is fires


def test_cgroup_limit_warning_names_the_limit() -> None:
    [warning] = memory_warnings(facts(limit=8 * GiB, usage=GiB))
    assert warning.code == "cgroup-limit" and "8.0 GiB" in warning.message
    assert memory_warnings(facts(limit=64 * GiB, usage=GiB)) == []


# ------------------------------------------------------------ allocator

_BATCHES = """
import resource, sys
from packdata.host.allocator import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    print("unsupported")
    sys.exit()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
batch = [bytearray(64 << 10) for _ in range(1024)]  # 64 MiB in 64 KiB buffers, as a convert batch of files
del batch
start = faults()
for _ in range(5):
    batch = [bytearray(64 << 10) for _ in range(1024)]
    del batch
print(faults() - start)
"""


def test_keep_freed_memory_reuses_the_pages_of_freed_batches() -> None:
    """After the call, batch after batch of freed buffers is reused instead of faulted in again."""

    def faults(mode: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", _BATCHES, mode], check=True, capture_output=True, text=True
        ).stdout.strip()

    kept = faults("keep")
    if kept == "unsupported":
        pytest.skip("this C library has no mallopt (not glibc)")
    default = int(faults("default"))
    # five batches of 64 MiB are 80k pages: the default returns each batch to the kernel and faults it back
    assert default > 40_000
    assert int(kept) < default // 10
