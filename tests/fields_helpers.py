"""Helpers shared by the multi-field tests (tests/test_fields_*.py)."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import image_bytes

KEYS = ["0001", "a b", "café", "x-2"]


def _grouped(root: Path) -> Path:
    """A grouped folder: image + caption + JSON (+ a mask for some), keys with spaces and unicode, one class folder."""
    root.mkdir()
    for i, key in enumerate(KEYS):
        (root / f"{key}.jpg").write_bytes(image_bytes(i))
        (root / f"{key}.txt").write_text(f"caption {i} ünï" if i else "", encoding="utf-8")  # an empty caption
        (root / f"{key}.json").write_text(json.dumps({"boxes": [i, i + 1]}), encoding="utf-8")
        if i % 2:
            (root / f"{key}.seg.png").write_bytes(image_bytes(100 + i, fmt="PNG"))
    (root / "lonely.jpg").write_bytes(image_bytes(7))  # no caption: skipped under --require jpg,txt
    (root / "dogs.v2").mkdir()  # a class folder with a dot: key "dogs.v2/d"
    (root / "dogs.v2" / "d.jpg").write_bytes(image_bytes(8))
    (root / "dogs.v2" / "d.txt").write_text("a dog", encoding="utf-8")
    return root


def _fields_of(folder: Path, key: str) -> dict[str, bytes]:
    folder_part, _, stem = key.rpartition("/")
    directory = folder / folder_part if folder_part else folder
    return {p.name[len(stem) + 1 :]: p.read_bytes() for p in directory.iterdir() if p.name.startswith(stem + ".")}


def _listed(batch: list) -> list:
    return batch


def _same_tree(comparison: filecmp.dircmp) -> bool:
    _, mismatch, errors = filecmp.cmpfiles(comparison.left, comparison.right, comparison.common_files, shallow=False)
    if comparison.left_only or comparison.right_only or mismatch or errors:
        return False
    return all(_same_tree(sub) for sub in comparison.subdirs.values())


def _convert_in_an_ascii_locale(src: Path, dst: Path) -> None:
    """Convert in a Python whose file names decode as ASCII (a machine whose locale is not UTF-8)."""
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = "import sys, packdata; packdata.convert(sys.argv[1], sys.argv[2], progress=False)"
    subprocess.run([sys.executable, "-c", code, str(src), str(dst)], env=env, check=True)
