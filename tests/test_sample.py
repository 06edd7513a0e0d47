"""The built-in sample dataset: deterministic, ImageFolder-shaped, natural-looking, in bounds."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from packdata.demo_data import make_sample_images, make_sample_texts

NUM_IMAGES = 24
NUM_CLASSES = 4


def digest(root: Path) -> dict[str, str]:
    """Every file's relative path -> SHA-256."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sample") / "images"
    assert make_sample_images(root, num_images=NUM_IMAGES, num_classes=NUM_CLASSES, seed=7, workers=1) == NUM_IMAGES
    return root


def test_images_layout(images: Path) -> None:
    classes = sorted(p.name for p in images.iterdir())
    assert len(classes) == NUM_CLASSES
    assert all(p.is_dir() for p in images.iterdir())
    files = sorted(images.rglob("*"))
    files = [p for p in files if p.is_file()]
    assert len(files) == NUM_IMAGES
    assert not [p for p in files if p.name.startswith(".")], "temporary files were left behind"
    for p in files:
        index = int(p.stem.removeprefix("img_"))
        assert p.name == f"img_{index:06d}.jpg"
        assert classes.index(p.parent.name) == index % NUM_CLASSES  # sorted folder order is the class index
    assert {p.parent.name for p in files} == set(classes)
    assert all(len(list((images / c).iterdir())) == NUM_IMAGES // NUM_CLASSES for c in classes)


def test_images_are_jpeg_in_range_and_not_noise(images: Path) -> None:
    sizes = []
    for p in sorted(images.rglob("*.jpg")):
        with Image.open(p) as im:
            assert im.format == "JPEG"
            assert im.mode == "RGB"
            assert 320 <= im.width <= 480 and 280 <= im.height <= 420
            pixels = np.asarray(im.convert("RGB"), dtype=np.int16)
        # Natural images are locally smooth; uniform noise gives about 85 here.
        assert np.abs(np.diff(pixels, axis=1)).mean() < 20
        assert pixels.std() > 10, "image is almost flat"
        sizes.append(p.stat().st_size)
    assert 10_000 < np.mean(sizes) < 120_000


def test_images_deterministic_and_independent_of_workers(images: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert make_sample_images(again, num_images=NUM_IMAGES, num_classes=NUM_CLASSES, seed=7, workers=2) == NUM_IMAGES
    assert digest(again) == digest(images)
    other = tmp_path / "other"
    make_sample_images(other, num_images=4, num_classes=NUM_CLASSES, seed=8, workers=1)
    assert set(digest(other).values()).isdisjoint(digest(images).values())


def test_images_overwrite_and_few_images(tmp_path: Path) -> None:
    root = tmp_path / "few"
    assert make_sample_images(root, num_images=2, num_classes=5, workers=1) == 2
    first = digest(root)
    assert len(first) == 2
    assert len(list(root.iterdir())) == 2  # no empty class folders
    assert make_sample_images(root, num_images=2, num_classes=5, workers=1) == 2
    assert digest(root) == first
    assert make_sample_images(tmp_path / "none", num_images=0) == 0
    numpy_ints = tmp_path / "numpy"
    assert make_sample_images(numpy_ints, num_images=np.int64(2), num_classes=np.int32(5), workers=1) == 2  # type: ignore[arg-type]
    assert digest(numpy_ints) == first


@pytest.mark.parametrize(
    "kwargs",
    [{"num_images": -1}, {"num_classes": 0}, {"workers": 0}, {"seed": -1}, {"num_images": 1.5}],
)
def test_images_reject_bad_arguments(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        make_sample_images(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_texts(tmp_path: Path) -> None:
    root = tmp_path / "texts"
    assert make_sample_texts(root, num_files=60, num_classes=3, seed=1) == 60
    classes = sorted(p.name for p in root.iterdir())
    assert len(classes) == 3
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) == 60
    assert {p.suffix for p in files} <= {".txt", ".json", ".md"}
    assert ".txt" in {p.suffix for p in files}
    text = ""
    for p in files:
        index = int(p.stem.removeprefix("doc_"))
        assert classes.index(p.parent.name) == index % 3
        data = p.read_bytes()
        assert 100 <= len(data) <= 4096
        content = data.decode("utf-8")
        if p.suffix == ".json":
            assert json.loads(content)["label"] == p.parent.name
        text += content
    assert any(ord(c) > 127 for c in text)

    again = tmp_path / "again"
    make_sample_texts(again, num_files=60, num_classes=3, seed=1)
    assert digest(again) == digest(root)
    other = tmp_path / "other"
    make_sample_texts(other, num_files=60, num_classes=3, seed=2)
    assert digest(other) != digest(root)


def test_texts_mix_formats_and_reject_bad_arguments(tmp_path: Path) -> None:
    make_sample_texts(tmp_path / "t", num_files=200, num_classes=4)
    suffixes = [p.suffix for p in (tmp_path / "t").rglob("*") if p.is_file()]
    assert {".txt", ".json", ".md"} == set(suffixes)
    assert suffixes.count(".txt") > len(suffixes) / 2
    with pytest.raises(ValueError):
        make_sample_texts(tmp_path / "bad", num_files=-1)
    with pytest.raises(ValueError):
        make_sample_texts(tmp_path / "bad", num_classes=0)


_POOLS = """
import concurrent.futures, json, os, sys
open(sys.argv[1], "w").write(str(os.getpid()))  # join the cgroup: 1 CPU's worth of time, whatever the affinity
from packdata.demo_data import make_sample_images
sizes = []
real_init = concurrent.futures.ProcessPoolExecutor.__init__
def init(self, max_workers=None, *args, **kwargs):  # the real pool, its size noted
    sizes.append(max_workers)
    real_init(self, max_workers, *args, **kwargs)
concurrent.futures.ProcessPoolExecutor.__init__ = init
make_sample_images(sys.argv[2], num_images=8, num_classes=2)
print(json.dumps(sizes))
"""


def test_sample_images_render_with_the_cpus_a_cgroup_quota_leaves_not_the_affinitys(
    tmp_path: Path, cgroup: Any
) -> None:
    """make_sample_images' default workers counted the affinity's CPUs only: under a cgroup quota of 1 CPU on a
    2-CPU host it started 2 processes that the quota then throttled."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 CPUs for the quota to allow fewer")
    groups = cgroup(**{"cpu.max": "100000 100000"})
    done = subprocess.run(
        [sys.executable, "-c", _POOLS, str(groups[0] / "cgroup.procs"), str(tmp_path / "images")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []  # 1 worker: rendered in the calling process, no pool
    assert len(list((tmp_path / "images").rglob("*.jpg"))) == 8
