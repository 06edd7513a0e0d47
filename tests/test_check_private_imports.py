"""scripts/check_private_imports.py: which private imports cross a package, on small trees built in tmp_path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_private_imports.py"


def _tree(root: Path, files: dict[str, str]) -> Path:
    """Write ``packdata/...`` files (relative path -> source) under ``root``, with empty ``__init__.py`` files."""
    for name in ("packdata/__init__.py", "packdata/formats/__init__.py", "packdata/reading/__init__.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).touch()
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60)


def test_a_private_name_of_a_subpackage_init_stays_in_that_subpackage(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "packdata/formats/__init__.py": "from packdata.formats.lmdb import _open\n_REGISTRY = {}\n",
            "packdata/formats/lmdb.py": "from packdata.formats import _REGISTRY\n_open = None\n",
        },
    )
    result = _check(root)
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip() == "no private names cross a package"


def test_a_private_name_of_a_subpackage_init_imported_from_outside_is_reported(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "packdata/formats/__init__.py": "_REGISTRY = {}\n",
            "packdata/units.py": "from packdata.formats import _REGISTRY\n",
            "packdata/reading/__init__.py": "from packdata.formats import _REGISTRY\n",
        },
    )
    result = _check(root)
    assert result.returncode == 1
    assert sorted(result.stdout.splitlines()) == [
        f"{root / 'packdata/reading/__init__.py'}:1: packdata.reading imports _REGISTRY from packdata.formats",
        f"{root / 'packdata/units.py'}:1: packdata.units imports _REGISTRY from packdata.formats",
    ]


def test_relative_imports_are_resolved_and_other_top_level_packages_ignored(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "packdata/formats/__init__.py": "_REGISTRY = {}\n",
            "packdata/formats/lmdb.py": "from . import _REGISTRY\n_open = None\n",  # its own package: fine
            "packdata/reading/datasets.py": "from ..formats import _REGISTRY\nfrom ..formats.lmdb import _open\n",
            "packdata/reading/__init__.py": "from .datasets import _x\nfrom packdata_extra import _y\n",
        },
    )
    result = _check(root)
    assert result.returncode == 1
    shown = root / "packdata/reading/datasets.py"
    assert sorted(result.stdout.splitlines()) == [
        f"{shown}:1: packdata.reading.datasets imports _REGISTRY from packdata.formats",
        f"{shown}:2: packdata.reading.datasets imports _open from packdata.formats.lmdb",
    ]
