"""Hostile payloads in a pack a training job reads: each is refused in one line naming pack, sample and field."""

from __future__ import annotations

import io
import re
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import image_bytes
from PIL import Image
from torch.utils.data import DataLoader

import packdata
from packdata.errors import ImageFormatError
from packdata.pack.images import SCAN_LIMIT
from packdata.pack.turbo import turbojpeg
from packdata.reading.decode import decode_pil


def _huge_jpeg() -> bytes:
    """A 64x48 JPEG whose frame header claims 30000x30000 pixels (over PIL's decompression-bomb limit)."""
    data = bytearray(image_bytes(1))
    sof = data.index(b"\xff\xc0")  # baseline frame header: length(2) precision(1) height(2) width(2)
    data[sof + 5 : sof + 9] = (30000).to_bytes(2, "big") * 2
    return bytes(data)


@pytest.mark.parametrize(
    "decode", ["pil", packdata.DecodeJPEG(224), packdata.DecodeCrop(64, seed=0)], ids=["pil", "jpeg", "crop"]
)
def test_an_image_over_the_decompression_bomb_limit_is_named(tmp_path: Path, decode) -> None:
    """PIL's DecompressionBombError is no OSError: it left the dataset raw, naming neither sample nor pack."""
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "bomb.jpg").write_bytes(_huge_jpeg())
    (src / "cat" / "fine.jpg").write_bytes(image_bytes(2))
    pack = tmp_path / "p.lmdb"
    packdata.convert(src, pack, progress=False)
    ds = packdata.LMDBDataset(pack, decode=decode)
    message = re.escape(f"{pack}: sample 'cat/bomb.jpg' (index 0): image is too large to decode (Image size")
    with pytest.raises(ImageFormatError, match=message + r".*MAX_IMAGE_PIXELS"):
        ds[0]
    assert ds[1][1] == 0  # the next sample still reads
    with pytest.raises(ImageFormatError, match=re.escape("sample 'cat/bomb.jpg' (index 0)")):
        next(iter(DataLoader(ds, batch_size=None, sampler=[0], num_workers=1)))  # named in the worker too


def test_an_image_field_over_the_decompression_bomb_limit_is_named(tmp_path: Path) -> None:
    pack = tmp_path / "p.lmdb"
    packdata.write_pack([{"__key__": "k", "jpg": _huge_jpeg(), "txt": "a caption"}], pack, progress=False)
    with pytest.raises(ImageFormatError, match=re.escape(f"{pack}: sample 'k' (index 0), field 'jpg': image is too")):
        packdata.LMDBDataset(pack)[0]
    assert packdata.LMDBDataset(pack, fields=("txt",))[0] == ("a caption",)


@pytest.mark.parametrize(
    "decode", ["pil", packdata.DecodeJPEG(224), packdata.DecodeCrop(64, seed=0)], ids=["pil", "jpeg", "crop"]
)
def test_the_decompression_bomb_warning_names_the_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decode
) -> None:
    """PIL's DecompressionBombWarning (over MAX_IMAGE_PIXELS, at most twice it) named no image: which sample?"""
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "big.jpg").write_bytes(image_bytes(1))  # 64x48: 3072 pixels
    pack = tmp_path / "p.lmdb"
    packdata.convert(src, pack, progress=False)
    fields = tmp_path / "f.lmdb"
    packdata.write_pack([{"__key__": "k", "jpg": image_bytes(2), "txt": "a caption"}], fields, progress=False)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    named = re.escape(f"{pack}: sample 'cat/big.jpg' (index 0): image of 64x48 (3072 pixels) is over PIL.Image.")
    with pytest.warns(Image.DecompressionBombWarning, match=named + r"MAX_IMAGE_PIXELS \(2000\)"):
        packdata.LMDBDataset(pack, decode=decode)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: each message once per place
        for _ in range(3):
            packdata.LMDBDataset(pack, decode=decode)[0]
    assert sum("sample 'cat/big.jpg'" in str(w.message) for w in caught) == 1  # once per sample
    named = re.escape(f"{fields}: sample 'k' (index 0), field 'jpg': image of 64x48 (3072 pixels)")
    with pytest.warns(Image.DecompressionBombWarning, match=named):
        assert packdata.LMDBDataset(fields, decode={"jpg": decode})[0]["txt"] == "a caption"


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes((0xFF, marker)) + struct.pack(">H", len(payload) + 2) + payload


def _progressive_jpeg(side: int, scans: int) -> bytes:
    """A flat grey ``side`` x ``side`` progressive JPEG of ``scans`` scans, its progression valid (up to 883 scans).

    A DC scan, then per AC coefficient a first scan at bit 13 and its 13
    refinements; every coefficient is 0, so a scan is one end-of-band run over
    all blocks (``side`` a power of two): a few bytes, yet a pass over the image.
    """
    blocks = (side // 8) ** 2
    run = min(blocks.bit_length() - 1, 14)  # EOBRUN of 2**run blocks: Huffman code "0" and run zero bits
    bits = (blocks >> run) * (1 + run)
    ac_data = b"\x00" * (bits // 8) + (bytes((0xFF >> bits % 8,)) if bits % 8 else b"")  # padded with 1 bits
    table = bytes((1,) + (0,) * 15)  # one Huffman code, "0"
    out = [b"\xff\xd8", _segment(0xDB, b"\x00" + b"\x01" * 64)]
    out.append(_segment(0xC2, struct.pack(">BHHB", 8, side, side, 1) + b"\x01\x11\x00"))
    out += [_segment(0xC4, b"\x00" + table + b"\x00"), _segment(0xC4, b"\x10" + table + bytes((run << 4,)))]
    out.append(_segment(0xDA, b"\x01\x01\x00\x00\x00\x00") + b"\x00" * (blocks // 8))  # DC: code "0" a block
    plan = [(k, 0, 13) for k in range(1, 64)] + [(k, a + 1, a) for a in range(12, -1, -1) for k in range(1, 64)]
    for k, high, low in plan[: scans - 1]:
        out.append(_segment(0xDA, b"\x01\x01\x00" + bytes((k, k, high << 4 | low))) + ac_data)
    return b"".join(out) + b"\xff\xd9"


DECODERS = [
    pytest.param(decode_pil, id="pil"),
    pytest.param(packdata.DecodeJPEG(224), id="jpeg"),
    pytest.param(packdata.DecodeCrop(32, seed=0, turbo=False), id="crop"),
    pytest.param(
        packdata.DecodeCrop(32, seed=0, turbo=True) if turbojpeg() else None,
        id="crop-turbo",
        marks=pytest.mark.skipif(turbojpeg() is None, reason="no TurboJPEG 3 library"),
    ),
]


@pytest.mark.parametrize("decode", DECODERS)
def test_a_jpeg_of_more_scans_than_the_limit_is_refused_before_decoding(decode) -> None:
    """PIL's libjpeg has no scan limit: 883 scans of a 4096x4096 grey JPEG (70 KB) took 3 s, 5,883 scans as long.

    Only TurboJPEG stopped at 500 scans, after decoding them. Now every decoder
    refuses such a file from its markers, and a JPEG of 500 scans still decodes.
    """
    assert decode(_progressive_jpeg(64, SCAN_LIMIT)).getextrema() == ((128, 128),) * 3  # flat grey
    with pytest.raises(ImageFormatError, match=r"JPEG has 883 start-of-scan markers, more than the 500 scans"):
        decode(_progressive_jpeg(4096, 883))


def test_a_progressive_jpeg_as_encoders_write_it_decodes() -> None:
    out = io.BytesIO()
    Image.open(io.BytesIO(image_bytes(3))).save(out, "JPEG", progressive=True)
    assert decode_pil(out.getvalue()).size == (64, 48)


def test_convert_skips_a_jpeg_of_too_many_scans_saying_so(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "scans.jpg").write_bytes(_progressive_jpeg(64, SCAN_LIMIT + 1))
    (src / "cat" / "fine.jpg").write_bytes(image_bytes(2))
    result = packdata.convert(src, tmp_path / "p.lmdb", verify_images=True, progress=False)
    assert result.skipped == {"corrupt image": 1}
    assert result.skip_examples[0]["key"] == "cat/scans.jpg"
    assert result.skip_examples[0]["detail"].startswith("JPEG has 501 start-of-scan markers")


def _npy(header: str, body: bytes) -> bytes:
    """A version-1 ``.npy`` file of ``header`` (a dict literal, padded as numpy pads it) and ``body``."""
    text = header.encode("latin1")
    text += b" " * (-(10 + len(text) + 1) % 16) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + body


def test_an_npy_header_whose_shape_numpy_cannot_take_is_named(tmp_path: Path) -> None:
    """A shape of True, or of 2**70 items of 0 bytes, passed the length check and left numpy as a bare error."""
    rows = [
        {"__key__": "bool", "npy": _npy("{'descr': '<f8', 'fortran_order': False, 'shape': (True,), }", bytes(8))},
        {"__key__": "huge", "npy": _npy(f"{{'descr': '|S0', 'fortran_order': False, 'shape': ({2**70},), }}", b"")},
    ]
    pack = tmp_path / "p.lmdb"
    packdata.write_pack(rows, pack, progress=False)
    ds = packdata.LMDBDataset(pack)
    shapes = [("bool", "its header's shape (True,) is not"), ("huge", f"its header's shape ({2**70},) is not")]
    for index, (key, problem) in enumerate(shapes):
        message = f"{pack}: sample '{key}' (index {index}), field 'npy': .npy array cannot be read ({problem}"
        with pytest.raises(packdata.DecodeError, match=re.escape(message)):
            ds[index]


def _sequential_jpeg(side: int, scans: int) -> bytes:
    """A baseline ``side`` x ``side`` JPEG of three components in ``scans`` scans, the first of component 1 only.

    Its first scan is PIL's grey JPEG's; a first scan of one component makes
    libjpeg read scans until the end marker, and each later one (empty here,
    ten bytes) is a pass over its component's blocks: a valid file needs one a component.
    """
    out = io.BytesIO()
    Image.new("L", (side, side), 128).save(out, "JPEG")
    grey = out.getvalue()
    start = grey.index(b"\xff\xc0")  # the tables before it are kept
    first_scan = grey.index(b"\xff\xda")
    frame = _segment(0xC0, struct.pack(">BHHB", 8, side, side, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00")
    scan = [_segment(0xDA, bytes((1, component, 0, 0, 63, 0))) for component in (1, 2, 3)]
    data = grey[first_scan + 10 : grey.rindex(b"\xff\xd9")]  # component 1's blocks
    later = [scan[1], scan[2], *[scan[0]] * (scans - 3)]
    return b"".join([grey[:start], frame, scan[0], data, *later, b"\xff\xd9"])


@pytest.mark.parametrize("decode", DECODERS)
def test_a_sequential_jpeg_of_more_scans_than_the_limit_is_refused(decode, request) -> None:
    """Only progressive JPEGs had their scans counted, but libjpeg decodes any number of a sequential one too.

    A 2048x2048 one of 1,000 scans (59 KB) took 0.7 s to decode with PIL
    against 0.05 s for its 3 scans, and nothing bounds the count. (TurboJPEG,
    stopping at a warning, refuses the empty scans as damage.)
    """
    if request.node.callspec.id == "crop-turbo" or (request.node.callspec.id != "crop" and turbojpeg()):
        with pytest.raises(ImageFormatError, match="JPEG cannot be decoded: Corrupt JPEG data"):
            decode(_sequential_jpeg(64, SCAN_LIMIT))
    else:
        assert decode(_sequential_jpeg(64, SCAN_LIMIT)).size[0] > 0
    with pytest.raises(ImageFormatError, match=r"JPEG has 1000 start-of-scan markers, more than the 500 scans"):
        decode(_sequential_jpeg(2048, 1000))


def test_jpeg_frame_names_the_frame() -> None:
    """Convert's cheap check walks a JPEG's header to its frame; None where the header cannot be walked."""
    from packdata.pack.images import jpeg_frame

    for progressive, frame in ((False, 0xC0), (True, 0xC2)):
        out = io.BytesIO()
        Image.new("RGB", (64, 48), (10, 200, 30)).save(out, "JPEG", progressive=progressive)
        assert jpeg_frame(out.getvalue()) == frame
    assert jpeg_frame(_progressive_jpeg(64, SCAN_LIMIT)) == 0xC2
    assert jpeg_frame(_sequential_jpeg(64, SCAN_LIMIT)) == 0xC0
    assert jpeg_frame(b"\xff\xd8\xff\xe0\x00\x01") is None
    # FF 00 is no marker (decoders skip it): read as one with a length, it hid a baseline frame in an APP1
    fake = b"\xff\xc0\x00\x0b\x08\x00\x10\x00\x10\x01\x01\x11\x00\xff\xda\x00\x02"
    progressive = _progressive_jpeg(64, 10)
    hidden = b"\xff\xd8\xff\x00\x00\x06\xff\xe1" + struct.pack(">H", len(fake) + 2) + fake + progressive[2:]
    assert jpeg_frame(hidden) is None


@pytest.mark.parametrize("decode", DECODERS)
def test_a_16_bit_image_is_refused_not_clipped_white(tmp_path: Path, decode) -> None:
    """A 16-bit greyscale PNG went through convert("RGB"), which clips: mid-grey (32896) and 1000 alike came
    back 255, a white image, silently. Decoders now name it; an 8-bit one beside it decodes."""
    out = io.BytesIO()
    Image.fromarray(np.full((48, 64), 32896, dtype=np.uint16)).save(out, "PNG")
    pack, ds = _pack_of(tmp_path, {"deep.png": out.getvalue(), "flat.png": image_bytes(1, fmt="PNG")}, decode)
    message = re.escape(f"{pack}: sample 'c/deep.png' (index 0): image of mode I;16 has more than 8 bits a channel")
    with pytest.raises(ImageFormatError, match=message):
        ds[0]
    assert ds[1][0].mode == "RGB"


def _pack_of(tmp_path: Path, files: dict[str, bytes], decode) -> tuple[Path, packdata.LMDBDataset]:
    """A pack of ``files`` in class folder ``c``, and a dataset decoding it with ``decode``."""
    src = tmp_path / "src" / "c"
    src.mkdir(parents=True)
    for name, data in files.items():
        (src / name).write_bytes(data)
    pack = tmp_path / "p.lmdb"
    packdata.convert(tmp_path / "src", pack, progress=False)
    return pack, packdata.LMDBDataset(pack, decode=decode)


def _photo_jpeg(**options: object) -> bytes:
    """A 500x375 JPEG of gradients and noise (every block differs from flat grey)."""
    y, x = np.mgrid[0:375, 0:500]
    noise = np.random.default_rng(0).normal(0, 12, (375, 500, 3))
    pixels = np.stack([(x * 0.5 + y * 0.2) % 256, (y * 0.6) % 256, (x * y / 800) % 256], -1) + noise
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90, **options)
    return out.getvalue()


@pytest.mark.skipif(turbojpeg() is None, reason="no TurboJPEG 3 library")
@pytest.mark.parametrize("options", [{}, {"progressive": True}], ids=["baseline", "progressive"])
@pytest.mark.parametrize("decode", [decode_pil, packdata.DecodeJPEG(100)], ids=["pil", "jpeg"])
def test_a_jpeg_cut_short_and_closed_with_its_end_marker_is_refused_not_filled_grey(
    tmp_path: Path, decode, options: dict[str, object]
) -> None:
    """Cut mid-scan with FF D9 appended, a JPEG decoded through PIL with its missing blocks mid-grey:
    libjpeg only warns ("premature end of data segment") and Pillow drops its warnings. Where TurboJPEG
    is found the decoders go through it, which stops at the warning; a whole JPEG gives PIL's pixels."""
    whole = _photo_jpeg(**options)
    grey = io.BytesIO()
    Image.open(io.BytesIO(whole)).convert("L").save(grey, "JPEG", **options)
    for data in (whole, grey.getvalue()):  # PIL's pixels, at DecodeJPEG's scale too
        with Image.open(io.BytesIO(data)) as img:
            if isinstance(decode, packdata.DecodeJPEG):
                img.draft("RGB", (100, 100))
            assert np.array_equal(np.asarray(decode(data)), np.asarray(img.convert("RGB")))
    pack, ds = _pack_of(tmp_path, {"cut.jpg": whole[: len(whole) // 2] + b"\xff\xd9", "whole.jpg": whole}, decode)
    message = re.escape(f"{pack}: sample 'c/cut.jpg' (index 0): JPEG cannot be decoded: Corrupt JPEG data")
    with pytest.raises(ImageFormatError, match=message + ".*Convert with verify_images=True to skip such files"):
        ds[0]
    assert ds[1][0].size == ((500, 375) if decode is decode_pil else (250, 188))


@pytest.mark.skipif(turbojpeg() is None, reason="no TurboJPEG 3 library")
@pytest.mark.parametrize("decode", [decode_pil, packdata.DecodeJPEG(100)], ids=["pil", "jpeg"])
def test_a_cameras_mpo_is_decoded_as_the_jpeg_it_is(decode) -> None:
    """A camera's JPEG with a preview after it opens in PIL as MPO, not JPEG: the decoders took it for another
    format, so DecodeJPEG decoded it at full size and a damaged scan was read with PIL's grey blocks."""
    out = io.BytesIO()
    preview = Image.new("RGB", (160, 120), "blue")
    Image.open(io.BytesIO(_photo_jpeg())).save(out, "MPO", save_all=True, append_images=[preview], quality=90)
    mpo = out.getvalue()
    with Image.open(io.BytesIO(mpo)) as img:
        assert img.format == "MPO"
        if isinstance(decode, packdata.DecodeJPEG):
            img.draft("RGB", (100, 100))
        assert np.array_equal(np.asarray(decode(mpo)), np.asarray(img.convert("RGB")))
    scan = mpo.index(b"\xff\xda")
    cut = scan + (mpo.index(b"\xff\xd9", scan) - scan) // 4  # the first image's scan, a quarter in
    with pytest.raises(ImageFormatError, match="JPEG cannot be decoded: Corrupt JPEG data"):
        decode(mpo[:cut] + b"\xff\xd9" + mpo[cut + 2 :])  # its length and the offsets to the preview unchanged


@pytest.mark.skipif(turbojpeg() is None, reason="no TurboJPEG 3 library")
@pytest.mark.parametrize("options", [{}, {"progressive": True}], ids=["baseline", "progressive"])
@pytest.mark.parametrize(
    "decode",
    [decode_pil, packdata.DecodeJPEG(100), packdata.DecodeCrop(500, scale=(1, 1), ratio=(4 / 3, 4 / 3), turbo=True)],
    ids=["pil", "jpeg", "crop"],
)
def test_bytes_between_the_last_scan_and_the_end_marker_are_no_damage(decode, options: dict[str, object]) -> None:
    """'Corrupt JPEG data: 240 extraneous bytes before marker 0xd9', of a few ImageNet files and many
    cameras' (junk after the pixel data, all of which decodes), stopped TurboJPEG as damage: PIL's
    pixels, refused. Only junk before the end marker, after every scan, is let through."""
    whole = _photo_jpeg(**options)
    junk = whole[:-2] + b"\x7f" * 240 + b"\xff\xd9"
    assert np.array_equal(np.asarray(decode(junk)), np.asarray(decode(whole)))
    scan = whole.index(b"\xff\xda")
    restart = whole[: scan + 200] + b"\xff\xd0" + whole[scan + 200 :]  # a restart marker no interval asked for
    with pytest.raises(ImageFormatError, match="JPEG cannot be decoded: Corrupt JPEG data"):
        decode(restart)


@pytest.mark.skipif(turbojpeg() is None, reason="no TurboJPEG 3 library")
@pytest.mark.parametrize(
    "decode",
    [decode_pil, packdata.DecodeJPEG(100), packdata.DecodeCrop(500, scale=(1, 1), ratio=(4 / 3, 4 / 3), turbo=True)],
    ids=["pil", "jpeg", "crop"],
)
def test_a_sequential_scan_of_odd_parameters_is_no_damage(decode) -> None:
    """'Invalid SOS parameters for sequential JPEG': some phones (Samsung's) write a baseline scan's spectral
    selection as zeros, which libjpeg warns of and ignores. TurboJPEG stopped there, refusing the photo; it is
    decoded as libjpeg does, still stopping at any later warning (the same photo cut short)."""
    whole = _photo_jpeg()
    sos = whole.index(b"\xff\xda")
    params = sos + 5 + 2 * whole[sos + 4]  # after the marker, length, count and each component's tables
    odd = whole[:params] + b"\x00\x00\x00" + whole[params + 3 :]
    assert np.array_equal(np.asarray(decode(odd)), np.asarray(decode(whole)))
    with pytest.raises(ImageFormatError, match="premature end of data segment"):
        decode(odd[: len(odd) // 2] + b"\xff\xd9")
