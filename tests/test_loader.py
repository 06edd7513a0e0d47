"""Loader helpers, the standard transform and the reduced-size JPEG decode."""

from __future__ import annotations

import io
import os
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import image_bytes
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import packdata
from packdata.reading.decode import DecodeJPEG, decode_pil
from packdata.reading.loader import (
    BackgroundPrefetcher,
    CUDAPrefetcher,
    fast_collate,
    list_collate,
    one_ahead,
    worker_init_fn,
)
from packdata.reading.text import PadCollate
from packdata.reading.transforms import RandomResizedCrop, ToUint8Array, ToUint8Tensor, standard_transform

# ------------------------------------------------------------------ prefetchers


def test_cuda_prefetcher_passes_batches_through_on_cpu() -> None:
    batches = [(torch.arange(4) + i, {"y": torch.tensor([i])}, "meta") for i in range(5)]
    prefetcher = CUDAPrefetcher(batches, "cpu")
    assert not prefetcher.enabled
    out = list(prefetcher)
    assert len(out) == len(prefetcher) == 5
    for got, want in zip(out, batches, strict=True):
        assert got is want


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine without CUDA")
def test_cuda_prefetcher_falls_back_when_cuda_is_missing() -> None:
    loader = DataLoader(list(range(10)), batch_size=3)
    prefetcher = CUDAPrefetcher(loader, "cuda")
    assert not prefetcher.enabled
    assert [b.tolist() for b in prefetcher] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetcher_moves_batches_to_the_device() -> None:  # pragma: no cover - GPU only
    loader = DataLoader([(torch.full((3,), i), i) for i in range(8)], batch_size=2, pin_memory=True)
    out = list(CUDAPrefetcher(loader, "cuda"))
    assert all(x.is_cuda and y.is_cuda for x, y in out)
    assert torch.cat([x[:, 0] for x, _ in out]).cpu().tolist() == list(range(8))


class _FailsAt(torch.utils.data.Dataset):
    def __init__(self, size: int, bad: int) -> None:
        self.size, self.bad = size, bad

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise ValueError(f"sample {index} is damaged")
        return index


def test_cuda_prefetchers_lookahead_hands_out_every_batch_before_a_loader_error() -> None:
    """CUDAPrefetcher starts batch i + 1's copy before handing out batch i; an error in batch i + 1 was raised
    there, so batch i was never handed out (lost to a loop that stops or skips on errors). one_ahead, its
    lookahead, hands out batches 0..i, then raises."""
    loader = DataLoader(_FailsAt(10, bad=7), batch_size=2)
    events: list[str] = []

    def start(batch: torch.Tensor) -> torch.Tensor:
        events.append(f"start {batch.tolist()}")
        return batch

    def finish(batch: torch.Tensor) -> torch.Tensor:
        events.append(f"finish {batch.tolist()}")
        return batch

    got = []
    with pytest.raises(ValueError, match="sample 7 is damaged"):
        for batch in one_ahead(iter(loader), start, finish):
            events.append(f"use {batch.tolist()}")
            got.append(batch.tolist())
    assert got == [[0, 1], [2, 3], [4, 5]]
    assert events[:4] == ["start [0, 1]", "finish [0, 1]", "start [2, 3]", "use [0, 1]"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetcher_hands_out_every_batch_before_a_loader_error() -> None:  # pragma: no cover - GPU only
    got = []
    with pytest.raises(ValueError, match="sample 7 is damaged"):
        for batch in CUDAPrefetcher(DataLoader(_FailsAt(10, bad=7), batch_size=2, pin_memory=True), "cuda"):
            got.append(batch.cpu().tolist())
    assert got == [[0, 1], [2, 3], [4, 5]]


def test_background_prefetcher_yields_everything_in_order() -> None:
    items = list(range(100))
    prefetcher = BackgroundPrefetcher(iter(items), depth=3)
    assert list(prefetcher) == items
    again = BackgroundPrefetcher(range(7), depth=1)
    assert list(again) == list(again) == list(range(7))  # each iter() starts over


def test_background_prefetcher_propagates_exceptions_in_place() -> None:
    def broken():
        yield 1
        yield 2
        raise KeyError("record 3 is damaged")

    got = []
    with pytest.raises(KeyError, match="record 3 is damaged"):
        for item in BackgroundPrefetcher(broken(), depth=4):
            got.append(item)
    assert got == [1, 2]


def test_background_prefetcher_stops_its_thread_on_early_exit() -> None:
    others = {t for t in threading.enumerate() if t.name == "packdata-prefetch"}
    iterator = iter(BackgroundPrefetcher(range(10**9), depth=2))
    assert next(iterator) == 0
    ours = {t for t in threading.enumerate() if t.name == "packdata-prefetch"} - others
    assert len(ours) == 1
    iterator.close()
    assert not any(t.is_alive() for t in ours)


def test_background_prefetcher_rejects_depth_zero() -> None:
    with pytest.raises(ValueError, match="depth should be at least 1, but got depth=0"):
        BackgroundPrefetcher([], depth=0)


# ---------------------------------------------------------------------- collate


def test_fast_collate_equals_the_reference_stack() -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (20, 30, 3), dtype=np.uint8) for _ in range(5)]
    batch = [(img, i) for i, img in enumerate(images)]
    x, y = fast_collate(batch)
    reference = torch.stack([torch.from_numpy(img).permute(2, 0, 1) for img in images])
    assert x.dtype == torch.uint8 and x.shape == (5, 3, 20, 30)
    assert torch.equal(x, reference)
    assert y.dtype == torch.int64 and y.tolist() == [0, 1, 2, 3, 4]
    # PIL images and CHW tensors give the same batch
    assert torch.equal(fast_collate([(Image.fromarray(img), i) for i, img in enumerate(images)])[0], reference)
    assert torch.equal(fast_collate([(t, 0) for t in reference])[0], reference)


def test_fast_collate_grayscale_and_errors() -> None:
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4)
    x, _ = fast_collate([(gray, 1)])
    assert x.shape == (1, 1, 3, 4) and torch.equal(x[0, 0], torch.from_numpy(gray))
    with pytest.raises(ValueError, match="sample 1 is"):
        fast_collate([(np.zeros((4, 4, 3), np.uint8), 0), (np.zeros((5, 4, 3), np.uint8), 0)])
    with pytest.raises(TypeError, match="uint8"):
        fast_collate([(np.zeros((4, 4, 3), np.float32), 0)])
    with pytest.raises(ValueError, match="empty batch"):
        fast_collate([])


@pytest.mark.parametrize("mode", ["P", "PA", "CMYK", "YCbCr"])
def test_fast_collate_refuses_a_pil_mode_whose_array_is_not_pixel_values(mode: str) -> None:
    """A palette image's array is its indices (CMYK and YCbCr: other colour spaces): fast_collate stacked them
    as if they were pixels, silently. L, LA, RGB and RGBA are stacked as before."""
    image = Image.new("RGB", (4, 3), (200, 10, 10)).convert(mode)
    with pytest.raises(TypeError, match=f"mode '{mode}', whose array is not pixel values.*convert"):
        fast_collate([(image, 0)])
    for kept in ("L", "LA", "RGB", "RGBA"):
        assert fast_collate([(image.convert(kept), 0)])[0].shape == (1, len(kept), 3, 4)


@pytest.mark.parametrize(("mode", "value"), [("I;16", 1000), ("I", 300), ("F", 3.7), ("1", 1), ("P", 7)])
@pytest.mark.parametrize("to_uint8", [ToUint8Tensor(), ToUint8Array()])
def test_to_uint8_refuses_an_image_that_is_not_uint8_pixels(mode: str, value: float, to_uint8) -> None:
    """A 16-bit, 32-bit or float image was cast to uint8 (1000 became 232), a 1-bit one to 0/1, a palette's
    indices passed as pixels: each silently. An RGB image converts as before."""
    with pytest.raises(TypeError, match=f"{type(to_uint8).__name__} expects images of mode .* mode '{mode}'"):
        to_uint8(Image.new(mode, (4, 3), value))
    assert np.asarray(to_uint8(Image.new("RGB", (4, 3), (200, 10, 10)))).flatten()[0] == 200


def test_list_collate_keeps_samples() -> None:
    samples, labels = list_collate([(b"a", 1), (b"bc", 2)])
    assert samples == [b"a", b"bc"] and labels.tolist() == [1, 2]


_PIXELS = np.zeros((2, 2, 3), dtype=np.uint8)
_COLLATES = {
    "fast_collate": (fast_collate, _PIXELS),
    "list_collate": (list_collate, b"a"),
    "pad_collate": (PadCollate(), b"a"),
}


@pytest.mark.parametrize("name", list(_COLLATES))
def test_collates_refuse_a_label_that_is_not_a_whole_number(name: str) -> None:
    collate, sample = _COLLATES[name]
    whole = collate([(sample, 3), (sample, np.int64(4)), (sample, torch.tensor(5)), (sample, -1)])
    assert whole[-1].dtype == torch.int64 and whole[-1].tolist() == [3, 4, 5, -1]
    for label in (0.7, np.float32(2.5), "3", None):
        with pytest.raises(TypeError, match=rf"^{name} collates class labels into int64, but sample 1 has label"):
            collate([(sample, 1), (sample, label)])


# ------------------------------------------------------------ worker threads


class _Threads(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, str]:
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS", "")


def test_worker_init_fn_sets_one_thread_per_worker() -> None:
    loader = DataLoader(_Threads(), batch_size=None, num_workers=2, worker_init_fn=worker_init_fn)
    assert {tuple(item) for item in loader} == {(1, "1")}
    assert packdata.worker_init_fn is worker_init_fn


# -------------------------------------------------------------------- transform


def test_standard_transform_gives_uint8_chw_and_pickles() -> None:
    img = Image.open(io.BytesIO(image_bytes(0, (300, 200)))).convert("RGB")
    transform = pickle.loads(pickle.dumps(standard_transform(224)))
    out = transform(img)
    assert out.dtype == torch.uint8 and out.shape == (3, 224, 224)
    array = standard_transform(64, output="array")(img)
    assert array.dtype == np.uint8 and array.shape == (64, 64, 3)


def test_random_resized_crop_box_stays_inside_the_image() -> None:
    crop = RandomResizedCrop(32)
    torch.manual_seed(0)
    for w, h in [(300, 200), (40, 400), (1000, 10), (32, 32)]:
        for _ in range(50):
            left, top, right, bottom = crop.box(w, h)
            assert 0 <= left < right <= w and 0 <= top < bottom <= h


# ------------------------------------------------------------ reduced decode


@pytest.mark.parametrize(("size", "min_size"), [((1600, 1200), 224), ((1024, 768), 256), ((900, 700), (300, 400))])
def test_reduced_decode_is_at_least_the_requested_size(size: tuple[int, int], min_size) -> None:
    data = image_bytes(0, size)
    full = decode_pil(data)
    reduced = DecodeJPEG(min_size)(data)
    height, width = (min_size, min_size) if isinstance(min_size, int) else min_size
    assert reduced.mode == "RGB"
    assert reduced.width >= width and reduced.height >= height
    assert reduced.width * reduced.height < full.width * full.height  # it did scale down
    # one DCT step further would be too small
    assert reduced.width // 2 < width or reduced.height // 2 < height


def test_reduced_decode_keeps_small_and_non_jpeg_images_whole() -> None:
    small = image_bytes(0, (100, 80))
    assert DecodeJPEG(224)(small).size == (100, 80)
    png = image_bytes(0, (800, 600), fmt="PNG")
    assert DecodeJPEG(224)(png).size == (800, 600)


def test_reduced_decode_pickles_and_works_in_a_dataset(tmp_path: Path) -> None:
    decoder = DecodeJPEG(64)
    assert pickle.loads(pickle.dumps(decoder)) == decoder
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    for i in range(4):
        (src / f"{i}.jpg").write_bytes(image_bytes(i, (512, 384)))
    packdata.convert(tmp_path / "src", tmp_path / "p.lmdb", progress=False)
    dataset = packdata.LMDBDataset(tmp_path / "p.lmdb", decode=decoder)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=list_collate)
    sizes = [img.size for images, _ in loader for img in images]
    assert sizes == [(128, 96)] * 4
    with pytest.raises(ValueError, match="min_size should be positive"):
        DecodeJPEG(0)
