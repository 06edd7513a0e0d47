"""Only the declared image formats' PIL plug-ins are ever reached, in readers and in convert."""

from __future__ import annotations

import io
import re
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image
from torch.utils.data import DataLoader

from faults.hostile import overwrite_lmdb_record
from packdata import LMDBDataset, convert
from packdata.errors import ImageFormatError
from packdata.reading.decode import decode_pil


def _image(fmt: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 12), (200, 10, 10)).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "PCX"])
def test_decoder_refuses_other_formats_by_name(fmt: str) -> None:
    with pytest.raises(ImageFormatError, match=f"image format {fmt} is not allowed") as info:
        decode_pil(_image(fmt))
    assert info.value.detected == fmt


@pytest.mark.parametrize("fmt", ["EPS", "PPM", "PCX"])
def test_convert_skips_other_formats(image_folder: Path, tmp_path: Path, fmt: str) -> None:
    (image_folder / "cat" / "disguised.png").write_bytes(_image(fmt))
    result = convert(image_folder, tmp_path / "out.lmdb", verify_images=True, progress=False)
    assert result.skipped == {"unsupported image format": 1}
    assert result.skip_examples[0]["key"] == "cat/disguised.png"
    assert fmt in result.skip_examples[0]["detail"]


@pytest.mark.parametrize("multiprocessing_context", ["fork", "spawn"])
def test_reader_names_the_key_of_a_payload_in_another_format(
    image_folder: Path, tmp_path: Path, multiprocessing_context: str
) -> None:
    convert(image_folder, tmp_path / "out.lmdb", progress=False)
    key = LMDBDataset(tmp_path / "out.lmdb").keys[0]
    payload = _image("PPM")  # a hostile pack: record 0 holds a PPM under its JPEG key
    header = struct.pack("<4sBiIH", b"PDR1", 0, 0, zlib.crc32(payload), len(key.encode()))
    overwrite_lmdb_record(tmp_path / "out.lmdb", header + key.encode() + payload)
    ds = LMDBDataset(tmp_path / "out.lmdb")
    index = 0
    with pytest.raises(ImageFormatError, match=rf"sample .{re.escape(key)}. .*image format PPM is not allowed"):
        ds[index]
    loader = DataLoader(
        ds, batch_size=None, sampler=[index], num_workers=1, multiprocessing_context=multiprocessing_context
    )
    with pytest.raises(ImageFormatError, match=re.escape(key)):
        next(iter(loader))
