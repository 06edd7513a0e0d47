"""DecodeCrop: the boxes follow RandomResizedCrop's distribution, and the output is the full decode's crop."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch
from conftest import image_bytes
from PIL import Image
from torch.utils.data import DataLoader

import packdata
from packdata.errors import ConfigError, ImageFormatError
from packdata.pack import turbo as turbo_module
from packdata.reading.crop import DecodeCrop, crop_box
from packdata.reading.decode import decode_pil
from packdata.reading.transforms import RandomResizedCrop

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
HAVE_TURBO = turbo_module.turbojpeg() is not None
needs_turbo = pytest.mark.skipif(not HAVE_TURBO, reason="no TurboJPEG 3 library (pip install 'packdata[turbo]')")
BACKENDS = [False, pytest.param(True, marks=needs_turbo)]


def _torchvision_get_params(width: int, height: int, scale, ratio) -> tuple[int, int, int, int]:
    """``torchvision.transforms.RandomResizedCrop.get_params`` as torchvision writes it (torch's RNG)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = round(w / min(ratio))
    elif in_ratio > max(ratio):
        h = height
        w = round(h * max(ratio))
    else:
        w = width
        h = height
    return (height - h) // 2, (width - w) // 2, h, w


def _stats(boxes: list[tuple[int, int, int, int]], width: int, height: int) -> np.ndarray:
    b = np.asarray(boxes, dtype=np.float64)
    share = b[:, 2] * b[:, 3] / (width * height)
    aspect = np.log(b[:, 3] / b[:, 2])
    return np.array([share.mean(), *np.quantile(share, [0.1, 0.5, 0.9]), aspect.mean(), aspect.std()])


@pytest.mark.parametrize(("width", "height"), [(1000, 800), (640, 640), (300, 900)])
def test_boxes_follow_torchvisions_distribution(width: int, height: int) -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    ours = [crop_box(width, height, rng, SCALE, RATIO) for _ in range(20_000)]
    theirs = [_torchvision_get_params(width, height, SCALE, RATIO) for _ in range(20_000)]
    assert all(t >= 0 and left >= 0 and t + h <= height and left + w <= width for t, left, h, w in ours)
    # area share: mean and 10/50/90% quantiles; log aspect: mean and spread (2e4 draws: ~0.01 noise)
    assert np.abs(_stats(ours, width, height) - _stats(theirs, width, height)).max() < 0.02


def test_a_box_that_never_fits_falls_back_to_the_central_crop() -> None:
    top, left, h, w = crop_box(1000, 100, random.Random(1), (0.9, 1.0), RATIO)
    assert (h, w) == (100, 133) and (top, left) == (0, (1000 - 133) // 2)


@pytest.mark.parametrize("turbo", BACKENDS)
@pytest.mark.parametrize(("size", "ratio"), [((1, 1000), (100, 200)), ((1000, 1), (0.001, 0.002))])
def test_a_fallback_box_rounding_to_no_pixels_keeps_one(size: tuple[int, int], ratio, turbo: bool) -> None:
    """A 1-pixel-wide image at a ratio it cannot reach: the central crop is one pixel, never empty or 'damaged'."""
    width, height = size
    top, left = (height - 1) // 2, (width - 1) // 2
    assert crop_box(width, height, random.Random(0), SCALE, ratio) == (top, left, 1, 1)
    assert RandomResizedCrop(8, ratio=ratio).box(width, height) == (left, top, left + 1, top + 1)
    data = image_bytes(0, size, "JPEG" if turbo else "PNG")
    out = np.asarray(DecodeCrop(8, ratio=ratio, seed=0, turbo=turbo)(data), dtype=np.int16)
    with Image.open(io.BytesIO(data)) as img:
        centre = np.asarray(img.convert("RGB"), dtype=np.int16)[top, left]
    assert np.abs(out - centre).max() <= 1  # the central pixel, spread over the output


@pytest.mark.parametrize(
    "options",
    [{"scale": (0.08, math.inf)}, {"ratio": (0.5, math.inf)}, {"scale": (math.nan, 1.0)}, {"scale": (-0.5, 1.0)}],
)
def test_an_infinite_or_negative_range_is_refused_when_made(options: dict) -> None:
    """Not an OverflowError per sample in the workers: one ValueError where the decoder is made."""
    with pytest.raises(ValueError, match="positive finite ranges"):
        DecodeCrop(8, **options)
    if "ratio" in options:
        with pytest.raises(ValueError, match="ratio should satisfy"):
            RandomResizedCrop(8, **options)


def _reference(data: bytes, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    top, left, h, w = box
    with Image.open(io.BytesIO(data)) as img:
        full = img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    return np.asarray(full, dtype=np.int16)


@pytest.mark.parametrize("turbo", BACKENDS)
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_output_is_the_full_decodes_crop_within_jpeg_rounding(fmt: str, turbo: bool) -> None:
    data = image_bytes(3, (1600, 1200), fmt=fmt)
    decode = DecodeCrop(224, seed=11, turbo=turbo)
    boxes = random.Random(11)
    worst = 0.0
    for _ in range(12):
        box = crop_box(1600, 1200, boxes, SCALE, RATIO)
        out = np.asarray(decode(data), dtype=np.int16)
        assert out.shape == (224, 224, 3)
        worst = max(worst, float(np.abs(out - _reference(data, box, 224)).mean()))
    assert worst < (0.01 if fmt == "PNG" else 4.0), worst


@pytest.mark.parametrize("turbo", BACKENDS)
def test_exif_orientation_is_not_applied_as_the_pil_decoder_does_not(turbo: bool) -> None:
    """The documented behaviour: boxes are drawn on the stored pixels, as decode_pil returns them (no EXIF turn)."""
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees to display"
    out = io.BytesIO()
    with Image.open(io.BytesIO(image_bytes(3, (800, 600)))) as img:
        img.save(out, "JPEG", quality=95, exif=exif.tobytes())
    data = out.getvalue()
    assert decode_pil(data).size == (800, 600)
    box = crop_box(800, 600, random.Random(5), SCALE, RATIO)
    got = np.asarray(DecodeCrop(64, seed=5, turbo=turbo)(data), dtype=np.int16)
    assert np.abs(got - _reference(data, box, 64)).mean() < 4.0


@pytest.mark.parametrize("turbo", BACKENDS)
@pytest.mark.parametrize(
    ("fmt", "mode", "size"), [("JPEG", "RGB", 224), ("JPEG", "RGB", 64), ("JPEG", "L", 224), ("PNG", "RGB", 224)]
)
def test_tensor_output_is_the_pil_outputs_pixels(fmt: str, mode: str, size: int, turbo: bool) -> None:
    """``output="tensor"`` gives the PIL output's pixels as a CHW tensor, at full and at DCT scales."""
    image = Image.open(io.BytesIO(image_bytes(4, (1600, 1200), fmt=fmt))).convert(mode)
    out = io.BytesIO()
    image.save(out, format=fmt)
    data = out.getvalue()
    pil, tensor = DecodeCrop(size, seed=5, turbo=turbo), DecodeCrop(size, seed=5, turbo=turbo, output="tensor")
    for _ in range(12):  # boxes of 8-100% against 64 px: DCT scales 1/8 to 1; against 224: mostly full scale
        expected = torch.from_numpy(np.asarray(pil(data)).transpose(2, 0, 1).copy())
        got = tensor(data)
        assert got.dtype == torch.uint8 and got.is_contiguous() and torch.equal(got, expected)


def test_the_standard_transform_flips_a_tensor_as_it_flips_the_image() -> None:
    data = image_bytes(6, (640, 480))
    flip_to_tensor = packdata.standard_transform(96, crop=False)
    flip_to_array = packdata.standard_transform(96, crop=False, output="array")
    pil, tensor = DecodeCrop(96, seed=2), DecodeCrop(96, seed=2, output="tensor")
    flipped = 0
    for i in range(16):
        image, chw = pil(data), tensor(data)
        torch.manual_seed(i)
        expected = flip_to_tensor(image)
        torch.manual_seed(i)
        got = flip_to_tensor(chw)
        assert torch.equal(got, expected)
        flipped += not torch.equal(got, chw)
        torch.manual_seed(i)
        array = flip_to_array(chw)
        torch.manual_seed(i)
        assert np.array_equal(array, flip_to_array(image))
    assert 0 < flipped < 16  # both sides of the coin were tested
    with pytest.raises(TypeError, match="uint8 CHW tensor"):
        flip_to_tensor(torch.zeros(3, 8, 8))  # float: not an image the collate expects
    with pytest.raises(ValueError, match="output"):
        DecodeCrop(96, output="array")


def test_decode_crop_in_spawned_workers_differs_per_worker(tmp_path) -> None:
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for i in range(8):
        (src / f"{i}.jpg").write_bytes(image_bytes(1, (400, 300)))  # the same image: crops must still differ
    packdata.convert(tmp_path / "src", tmp_path / "p.lmdb", progress=False)
    for seed in (None, 0):  # a fixed seed gave every worker, and every epoch, the same boxes: 4 crops of 8
        ds = packdata.LMDBDataset(tmp_path / "p.lmdb", decode=packdata.DecodeCrop(64, seed=seed))
        loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
        crops = [np.asarray(img).tobytes() for _ in range(2) for img, _ in loader]  # two epochs
        assert len(crops) == 16 and len(set(crops)) == 16


def _textured_jpeg(size: tuple[int, int], mode: str, subsampling: int) -> bytes:
    """A JPEG with detail in every block (a one-column slip of the decoded region shows)."""
    w, h = size
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:h, 0:w]
    base = (np.sin(x / 3.0) * 60 + np.cos(y / 5.0) * 60 + 128)[..., None] + rng.normal(0, 20, (h, w, 3))
    pixels = np.clip(base * [1.0, 0.8, 0.6], 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels).convert(mode)
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90, subsampling=subsampling)
    return out.getvalue()


@needs_turbo
@pytest.mark.parametrize(("mode", "subsampling"), [("RGB", 0), ("RGB", 1), ("RGB", 2), ("L", 0)])
def test_turbo_region_decode_is_the_full_decodes_crop(mode: str, subsampling: int) -> None:
    """At full scale the region TurboJPEG decodes, cropped and resized, is PIL's full decode's crop."""
    data = _textured_jpeg((403, 301), mode, subsampling)  # odd sides: regions end inside a block
    decode = DecodeCrop(160, seed=3, turbo=True)
    boxes = random.Random(3)
    for _ in range(20):
        box = crop_box(403, 301, boxes, SCALE, RATIO)
        diff = np.abs(np.asarray(decode(data), dtype=np.int16) - _reference(data, box, 160))
        # the same IDCT and colour conversion; only the chroma upsampling at the region's edges differs
        assert diff.mean() < 0.3 and np.quantile(diff, 0.99) <= 3, (box, diff.mean(), np.quantile(diff, 0.99))


@needs_turbo
def test_turbo_and_pil_give_the_same_crops_at_every_dct_scale() -> None:
    data = _textured_jpeg((1600, 1200), "RGB", 2)
    turbo, pil = DecodeCrop(100, seed=8, turbo=True), DecodeCrop(100, seed=8, turbo=False)
    for _ in range(16):  # boxes from 1/8 to all of the area: scales 1/8 to 1/2 against 100 px
        diff = np.abs(np.asarray(turbo(data), dtype=np.int16) - np.asarray(pil(data), dtype=np.int16))
        assert diff.mean() < 3.0, diff.mean()


@pytest.mark.parametrize("turbo", BACKENDS)
def test_a_truncated_jpeg_is_named_whatever_the_box(turbo: bool) -> None:
    data = _textured_jpeg((400, 300), "RGB", 2)
    cut = data[: len(data) * 9 // 10]  # the last rows' scan data is gone: a box at the top never reaches them
    decode = DecodeCrop(64, scale=(0.08, 0.1), seed=0, turbo=turbo)
    for _ in range(20):
        with pytest.raises(OSError, match=r"truncated|Premature end"):
            decode(cut)


@needs_turbo
def test_turbo_decode_names_damage_inside_the_box() -> None:
    data = bytearray(_textured_jpeg((400, 300), "RGB", 2))
    data[len(data) // 3 : len(data) // 3 + 64] = b"\xff\x00" * 32 + b"\xff\xd0" * 16  # markers inside scan data
    tj = turbo_module.turbojpeg()
    assert tj is not None
    with pytest.raises(OSError, match="JPEG cannot be decoded"):
        tj.decode(bytes(data), (0, 0, 400, 300), 1)


@needs_turbo
def test_cmyk_and_png_take_pils_path_with_turbo() -> None:
    rgb = Image.open(io.BytesIO(_textured_jpeg((320, 240), "RGB", 0))).convert("CMYK")
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=90)
    for data in (out.getvalue(), image_bytes(2, (320, 240), fmt="PNG")):
        a, b = DecodeCrop(64, seed=4, turbo=True)(data), DecodeCrop(64, seed=4, turbo=False)(data)
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_turbo_true_without_the_library_fails_with_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(turbo_module, "_candidates", list)  # no library anywhere
    turbo_module.turbojpeg.cache_clear()
    try:
        with pytest.raises(ConfigError, match="packdata\\[turbo\\]"):
            DecodeCrop(64, turbo=True)
        assert np.asarray(DecodeCrop(64, seed=1)(image_bytes(1, (200, 150)))).shape == (64, 64, 3)
    finally:
        monkeypatch.undo()
        turbo_module.turbojpeg.cache_clear()


@needs_turbo
def test_a_library_path_that_is_not_turbojpeg_3_warns_and_the_next_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes.util

    libz = ctypes.util.find_library("z")
    if libz is None:
        pytest.skip("no libz to stand in for a wrong library")
    monkeypatch.setenv(turbo_module.ENV, libz)
    turbo_module.turbojpeg.cache_clear()
    try:
        with pytest.warns(UserWarning, match=turbo_module.ENV):
            found = turbo_module.turbojpeg()
        assert found is not None and found.path != libz
    finally:
        monkeypatch.undo()
        turbo_module.turbojpeg.cache_clear()


@needs_turbo
def test_a_box_outside_the_jpegs_own_header_is_named_as_damage() -> None:
    """The box comes from PIL's reading of the header; TurboJPEG's reading is checked against it before any pixel."""
    data = _textured_jpeg((64, 48), "RGB", 2)
    tj = turbo_module.turbojpeg()
    assert tj is not None
    for box in [(0, 0, 72, 48), (0, 0, 64, 56), (-8, 0, 32, 32), (16, 16, 16, 32)]:  # wider, taller, negative, empty
        with pytest.raises(OSError, match=r"JPEG header gives 64x48, too small for box"):
            tj.decode(data, box, 1)


@pytest.mark.parametrize("turbo", BACKENDS)
def test_a_header_claiming_a_huge_image_is_refused_before_decoding(turbo: bool) -> None:
    """A stranger's JPEG whose frame header claims 30000x30000: PIL's decompression-bomb check, on every path."""
    data = bytearray(_textured_jpeg((64, 48), "RGB", 2))
    sof = data.index(b"\xff\xc0")  # baseline frame header: length(2) precision(1) height(2) width(2)
    data[sof + 5 : sof + 9] = (30000).to_bytes(2, "big") * 2
    with pytest.raises(ImageFormatError, match=r"image is too large to decode \(Image size \(900000000 pixels\)"):
        DecodeCrop(64, seed=0, turbo=turbo)(bytes(data))
