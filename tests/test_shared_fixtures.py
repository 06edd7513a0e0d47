"""The shared test machinery of tests/conftest.py itself: what each test leaning on it must be able to rely on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import moto_s3

_CLASSES_FOLDER = """
import sys
from pathlib import Path
from conftest import classes_folder, tree_digest
root = classes_folder(Path(sys.argv[1]), {"cat": ["a.jpg", "b.jpg"], "dog": ["a.jpg"]})
print(sorted(tree_digest(root).items()))
"""


def test_a_moto_server_leaves_no_filesystem_with_its_listings_to_a_later_server_on_its_port() -> None:
    """s3fs caches a filesystem per options: a later server given a stopped one's port (the kernel hands freed ports
    out again) got the stopped server's filesystem back, which listed 'packs' and its objects from its cache, so
    the later server's setup failed (mkdir('packs'): FileExistsError) or its tests read listings of objects gone."""
    s3fs = pytest.importorskip("s3fs")
    with moto_s3({"key": "testing-key-id", "secret": "testing-secret"}) as (options, fs):
        fs.pipe("packs/gone", b"1")
        assert fs.ls("packs") == ["packs/gone"]
    later = s3fs.S3FileSystem(**options)  # what a later server on the same port would be given
    assert later is not fs and "packs" not in later.dircache


def test_classes_folder_writes_the_same_images_whatever_the_hash_seed(tmp_path: Path) -> None:
    """It seeded each image with hash((class, file)), which PYTHONHASHSEED changes: the data differed run to run,
    so a test that failed on one run's images could not be run again on them."""
    digests = []
    for seed in ("1", "2"):
        root = str(Path(__file__).parents[1])  # this checkout's packdata, which conftest imports
        env = {
            **os.environ,
            "PYTHONHASHSEED": seed,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run(
            [sys.executable, "-c", _CLASSES_FOLDER, str(tmp_path / seed)],
            cwd=Path(__file__).parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        digests.append(done.stdout)
    assert digests[0] == digests[1]
