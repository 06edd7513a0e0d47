"""The open-file limit of a process that keeps files open for each shard it reads.

A dataset's reader keeps two or three descriptors open for every shard it has
read, so a process reading a pack of a few hundred shards can meet a soft limit
of 1,024 (many systems' default) long before its hard limit. The soft limit is
the process's own to raise, up to the hard limit, without privileges: readers
raise it when they first run out, as Go's runtime does at start.
"""

from __future__ import annotations

import resource  # here, not where first needed: that is when a process is out of files, and an import opens one

__all__ = ["max_map_count", "open_files_limit", "raise_open_files_limit"]


def open_files_limit() -> tuple[int, int]:
    """This process's ``(soft, hard)`` limits on open files (``ulimit -n``; -1 where there is none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(soft), int(hard)


def raise_open_files_limit() -> bool:
    """Raise this process's soft limit on open files to its hard limit; False where it already is or cannot be.

    A hard limit of "unlimited" is taken as the kernel's ceiling (``fs.nr_open``).
    """
    soft, hard = open_files_limit()
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
                target = int(f.read())
        except (OSError, ValueError):
            return False
    if soft == resource.RLIM_INFINITY or soft >= target:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError):
        return False
    return True


def max_map_count() -> int:
    """The memory maps one process may hold (``vm.max_map_count``; Linux's default, 65,530, where it cannot be read)."""
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530
