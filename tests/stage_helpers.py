"""Helpers shared by the tests of packdata stage, unstage and status (tests/test_stage_*.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from packdata.reading.datasets import LMDBDataset

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")


def _all_bytes(path: Path) -> list[tuple[bytes, int]]:
    ds = LMDBDataset(path, decode="bytes")
    return [ds[i] for i in range(len(ds))]
