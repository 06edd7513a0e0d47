"""Hostile payloads in a pack a training job reads: each is refused in one line naming pack, sample and field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import image_bytes
from torch.utils.data import DataLoader

import packdata
from packdata.errors import ImageFormatError


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
