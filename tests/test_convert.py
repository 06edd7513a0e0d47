"""convert: round trip, skips and their report, refusals, atomicity (resume: test_convert_resume.py)."""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import IMAGE_EXTS, expected_samples, image_bytes, tree_digest
from conftest import pack_contents as _pack_contents
from PIL import Image, ImageCms

from packdata import (
    CapacityError,
    ConfigError,
    LMDBDataset,
    PackWriter,
    SourceError,
    TFRecordDataset,
    convert,
    verify_pack,
)
from packdata.cli import main
from packdata.conversion.destination import partial_path
from packdata.formats.lmdb_env import encode_key
from packdata.pack.records import decode_record
from packdata.pack.turbo import turbojpeg


def test_round_trip_every_byte_key_and_label(image_folder: Path, tmp_path: Path) -> None:
    before = tree_digest(image_folder)
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False)
    expected = expected_samples(image_folder, IMAGE_EXTS)
    assert result.packed == len(expected) == 19
    assert _pack_contents(tmp_path / "out.lmdb") == expected
    assert tree_digest(image_folder) == before  # the source is never touched


def test_order_is_sorted_and_classes_follow_imagefolder(image_folder: Path, tmp_path: Path) -> None:
    convert(image_folder, tmp_path / "out.lmdb", progress=False)
    ds = LMDBDataset(tmp_path / "out.lmdb", decode="bytes")
    keys = list(ds.keys)
    assert ds.classes == ["cat", "dog", "zebra"]
    assert ds.class_to_idx == {"cat": 0, "dog": 1, "zebra": 2}
    assert keys == sorted(keys, key=lambda k: k.split("/")) and keys[0] == "cat/a.jpg"
    assert ds.targets[keys.index("root.jpg")] == -1 and ds.targets[keys.index("zebra/a.jpg")] == 2


def test_same_source_gives_same_content(image_folder: Path, tmp_path: Path) -> None:
    convert(image_folder, tmp_path / "a.lmdb", progress=False)
    convert(image_folder, tmp_path / "b.lmdb", progress=False)
    assert _pack_contents(tmp_path / "a.lmdb") == _pack_contents(tmp_path / "b.lmdb")
    for name in ("labels.i32", "keys.utf8", "key_offsets.i64", "sizes.i64"):
        assert (tmp_path / "a.lmdb/index" / name).read_bytes() == (tmp_path / "b.lmdb/index" / name).read_bytes()
    shard = "shard-00000.lmdb/data.mdb"  # byte-identical, so re-staging after a re-convert copies nothing
    assert (tmp_path / "a.lmdb" / shard).read_bytes() == (tmp_path / "b.lmdb" / shard).read_bytes()


def test_bad_files_are_skipped_counted_and_reported(bad_files: Path, tmp_path: Path) -> None:
    result = convert(bad_files, tmp_path / "out.lmdb", progress=False)
    assert result.skipped == {"corrupt image": 1, "empty": 1, "hidden": 1, "not image": 1}
    assert result.found == 23 and result.packed == 19
    report = [json.loads(line) for line in (tmp_path / "out.lmdb/skipped.jsonl").read_text().splitlines()]
    assert {(r["key"], r["reason"]) for r in report} == {
        ("cat/corrupt.jpg", "corrupt image"),
        ("dog/empty.jpg", "empty"),
        ("dog/.hidden.jpg", "hidden"),
        ("zebra/notes.txt", "not image"),
    }
    manifest = json.loads((tmp_path / "out.lmdb/manifest.json").read_text())
    assert manifest["skipped"]["count"] == 4 and manifest["skipped"]["report"] == "skipped.jsonl"


def test_on_error_fail_names_the_file_and_leaves_nothing(bad_files: Path, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"cat/corrupt\.jpg: corrupt image.*on_error='skip'"):
        convert(bad_files, tmp_path / "out.lmdb", on_error="fail", progress=False)
    assert not (tmp_path / "out.lmdb").exists()
    assert not partial_path(tmp_path / "out.lmdb").exists()
    # the CLI says the same in its own flags
    result = CliRunner().invoke(
        main, ["convert", str(bad_files), str(tmp_path / "out.lmdb"), "--on-error", "fail", "-q"]
    )
    assert result.exit_code == 1 and "corrupt.jpg: corrupt image" in result.output
    assert "pass --on-error skip" in result.output and "on_error=" not in result.output


def test_verify_images_catches_truncated_jpeg(image_folder: Path, tmp_path: Path) -> None:
    whole = image_bytes(7, size=(256, 256))
    (image_folder / "cat" / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    assert convert(image_folder, tmp_path / "lazy.lmdb", progress=False).skipped == {}
    result = convert(image_folder, tmp_path / "strict.lmdb", verify_images=True, progress=False)
    assert result.skipped == {"corrupt image": 1}
    assert result.skip_examples[0]["key"] == "cat/truncated.jpg"


@pytest.mark.skipif(turbojpeg() is None, reason="no TurboJPEG 3 library")
@pytest.mark.parametrize("options", [{"verify_images": True}, {"max_side": 64}], ids=["verify", "max-side"])
def test_a_jpeg_cut_short_and_closed_with_its_end_marker_is_skipped_when_decoded(
    image_folder: Path, tmp_path: Path, options: dict[str, object]
) -> None:
    """PIL decodes such a JPEG without a word, its missing blocks grey: verify_images passed it, and
    max_side re-encoded the grey into a whole JPEG that no decoder could find damaged any more."""
    whole = image_bytes(7, size=(256, 256))
    (image_folder / "cat" / "closed.jpg").write_bytes(whole[: len(whole) // 2] + b"\xff\xd9")
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False, **options)  # type: ignore[arg-type]
    assert result.skipped == {"corrupt image": 1}
    assert result.skip_examples == [
        {
            "key": "cat/closed.jpg",
            "reason": "corrupt image",
            "detail": "JPEG cannot be decoded: Corrupt JPEG data: premature end of data segment",
        }
    ]


def _png_flipped_to_other_pixels() -> bytes:
    """A 256x256 PNG with one bit of its image data flipped, which PIL decodes, to other pixels."""
    whole = image_bytes(1, size=(256, 256), fmt="PNG")
    pixels = np.asarray(Image.open(io.BytesIO(whole)))
    start = whole.index(b"IDAT") + 4
    for offset in range(start + 20, len(whole)):
        flipped = bytearray(whole)
        flipped[offset] ^= 0x10
        try:
            other = np.asarray(Image.open(io.BytesIO(flipped)))
        except OSError:
            continue
        if not np.array_equal(other, pixels):
            return bytes(flipped)
    raise AssertionError("no flip decodes")


@pytest.mark.parametrize("options", [{"verify_images": True}, {"max_side": 64}], ids=["verify", "max-side"])
def test_a_png_whose_checksum_fails_is_skipped_when_decoded(
    image_folder: Path, tmp_path: Path, options: dict[str, object]
) -> None:
    """PIL decodes a PNG without checking its chunks' CRCs: a flipped bit in its image data passed
    verify_images as other pixels, and max_side re-encoded them into a sound JPEG."""
    (image_folder / "cat" / "flipped.png").write_bytes(_png_flipped_to_other_pixels())
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False, **options)  # type: ignore[arg-type]
    assert result.skipped == {"corrupt image": 1}
    assert result.skip_examples[0]["key"] == "cat/flipped.png"
    assert "broken PNG file (bad header checksum in b'IDAT')" in result.skip_examples[0]["detail"]


def test_unreadable_file_is_skipped(image_folder: Path, tmp_path: Path) -> None:
    (image_folder / "cat" / "dangling.jpg").symlink_to(tmp_path / "gone.jpg")  # open() fails, even as root
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False)
    assert result.skipped == {"unreadable": 1}
    assert result.skip_examples == [
        {"key": "cat/dangling.jpg", "reason": "unreadable", "detail": "No such file or directory"}
    ]


def test_non_utf8_file_name_is_skipped_with_reason(image_folder: Path, tmp_path: Path) -> None:
    name = os.fsencode(image_folder / "cat") + b"/bad\xff.jpg"
    try:
        with open(name, "wb") as f:
            f.write(image_bytes(1))
    except OSError:
        pytest.skip("filesystem refuses non-UTF-8 names")
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False)
    assert result.skipped == {"name not UTF-8": 1}
    (line,) = [json.loads(x) for x in (tmp_path / "out.lmdb" / "skipped.jsonl").read_text().splitlines()]
    assert line["key"] == "cat/bad\\xff.jpg"  # the byte itself, as `ls -b` names it; once U+FFFD: no file found


@pytest.mark.parametrize("layout", ["classes", "grouped"])
def test_a_class_folder_named_in_non_utf8_bytes_is_no_class_and_its_files_are_skipped(
    tmp_path: Path, layout: str
) -> None:
    """Once the class reached the manifest, which cannot hold it: the run died at its very end, and every resume."""
    src = tmp_path / "src"
    (src / "good").mkdir(parents=True)
    bad = os.fsencode(src) + b"/cl\xe9ss"
    try:
        os.mkdir(bad)
    except OSError:
        pytest.skip("filesystem refuses non-UTF-8 names")
    if layout == "classes":
        (src / "good" / "1.txt").write_text("fine")
        Path(os.fsdecode(bad + b"/f.txt")).write_text("in a latin-1 named class folder")
    else:
        for stem, folder in (("a", os.fsencode(src / "good")), ("b", bad)):
            Path(os.fsdecode(folder + f"/{stem}.txt".encode())).write_text("text")
            Path(os.fsdecode(folder + f"/{stem}.json".encode())).write_text("{}")
    result = convert(src, tmp_path / "out.lmdb", progress=False, layout=layout)
    assert result.packed == 1 and result.skipped == {"name not UTF-8": 1 if layout == "classes" else 2}
    manifest = json.loads((tmp_path / "out.lmdb" / "manifest.json").read_text())
    assert manifest["classes"] == ["good"]


def test_a_destination_name_too_long_for_the_names_made_from_it_is_refused_before_packing(
    text_folder: Path, tmp_path: Path
) -> None:
    """A legal 242-byte name once packed everything, then failed to name its shards (ENAMETOOLONG), every resume too."""
    with pytest.raises(ConfigError, match=r"the destination's name is 242 bytes.* at most 215"):
        convert(text_folder, tmp_path / ("d" * 233 + ".tfrecord"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [text_folder.name]  # nothing made
    longest = tmp_path / ("d" * 206 + ".tfrecord")  # at the limit: every name made from it fits
    convert(text_folder, longest, progress=False)
    verify_pack(longest, progress=False)


def test_text_kind_round_trip(text_folder: Path, tmp_path: Path) -> None:
    result = convert(text_folder, tmp_path / "t.lmdb", progress=False)
    assert result.kind == "text" and result.packed == 20
    ds = LMDBDataset(tmp_path / "t.lmdb", decode="text")
    text, label = ds[ds.keys.index("pos/doc03.txt")]
    assert text == (text_folder / "pos/doc03.txt").read_text(encoding="utf-8") and label == 1


def test_max_side_reencodes_large_images_and_records_it(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a/big.png").write_bytes(image_bytes(1, size=(600, 400), fmt="PNG"))
    (src / "a/small.jpg").write_bytes(image_bytes(2, size=(100, 80)))
    result = convert(src, tmp_path / "out.lmdb", max_side=256, quality=80, progress=False)
    assert result.reencoded == 1
    # "bytes in" is what was read from the source, not the re-encoded (smaller) bytes written
    assert result.bytes_in == sum(f.stat().st_size for f in (src / "a").iterdir())
    assert result.bytes_out < result.bytes_in
    ds = LMDBDataset(tmp_path / "out.lmdb")
    assert ds[0][0].size == (256, 171)  # aspect ratio kept
    assert LMDBDataset(tmp_path / "out.lmdb", decode="bytes")[1][0] == (src / "a/small.jpg").read_bytes()
    manifest = json.loads((tmp_path / "out.lmdb/manifest.json").read_text())
    assert manifest["reencode"] == {"max_side": 256, "quality": 80, "count": 1}


def test_max_side_keeps_a_16_bit_image_as_it_is_instead_of_clipping_it_white(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    deep = Image.fromarray(np.arange(400 * 300, dtype=np.uint16).reshape(300, 400))  # mode I;16, up to 65535
    deep.save(src / "a/depth.png")
    (src / "a/photo.png").write_bytes(image_bytes(1, size=(400, 300), fmt="PNG"))
    with pytest.warns(UserWarning, match=r"a/depth\.png: image of mode I;16 has more than 8 bits a channel"):
        result = convert(src, tmp_path / "out.lmdb", max_side=64, progress=False)
    assert result.packed == 2 and result.reencoded == 1
    stored = LMDBDataset(tmp_path / "out.lmdb", decode="bytes")
    assert stored[0][0] == (src / "a/depth.png").read_bytes()  # every value kept, unresized
    assert Image.open(io.BytesIO(stored[1][0])).size == (64, 48)


def test_max_side_keeps_an_image_of_several_frames_as_it_is(tmp_path: Path) -> None:
    """An animated GIF or multi-page TIFF was re-encoded as its first frame: the others were gone from the pack."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    frames = [Image.new("RGB", (200, 100), colour) for colour in ("red", "lime", "blue")]
    for name in ("anim.gif", "stack.tif"):
        frames[0].save(src / "a" / name, save_all=True, append_images=frames[1:])
    mpo = io.BytesIO()  # a camera's photo with a preview: re-encoded as before
    frames[0].save(mpo, "MPO", save_all=True, append_images=frames[1:2])
    (src / "a/camera.jpg").write_bytes(mpo.getvalue())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = convert(src, tmp_path / "out.lmdb", max_side=64, progress=False)
    assert sorted(str(w.message) for w in caught) == [
        f"a/{name}: image has 3 frames, and a JPEG holds one; kept as it is, 200x100, not re-encoded"
        for name in ("anim.gif", "stack.tif")
    ]
    assert result.packed == 3 and result.reencoded == 1
    stored = LMDBDataset(tmp_path / "out.lmdb", decode="bytes")
    kept = {key: stored[i][0] == (src / key).read_bytes() for i, key in enumerate(stored.keys)}
    assert kept == {"a/anim.gif": True, "a/camera.jpg": False, "a/stack.tif": True}
    # a second page whose header has no width: PIL's frame count raised TypeError out of convert
    stack = (src / "a/stack.tif").read_bytes()
    width = stack.index(b"\x00\x01\x04\x00\x01\x00\x00\x00", stack.index(b"\x00\x01\x04\x00") + 1)
    (src / "a/stack.tif").write_bytes(stack[:width] + b"\xff\x0f" + stack[width + 2 :])
    (src / "a/anim.gif").unlink()
    with pytest.warns(UserWarning, match=r"a/stack\.tif: image's frames cannot be counted \(TypeError: Missing dim"):
        convert(src, tmp_path / "damaged.lmdb", max_side=64, progress=False)


@pytest.mark.parametrize(
    "options", [{}, {"verify_images": True}, {"max_side": 32}], ids=["plain", "verify", "max-side"]
)
def test_the_decompression_bomb_warning_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, object]
) -> None:
    """PIL's DecompressionBombWarning (over MAX_IMAGE_PIXELS, at most twice it) named no file: which one?"""
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat/big.png").write_bytes(image_bytes(1, fmt="PNG"))  # 64x48: 3072 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    named = re.escape("cat/big.png: image of 64x48 (3072 pixels) is over PIL.Image.MAX_IMAGE_PIXELS (2000)")
    with pytest.warns(Image.DecompressionBombWarning, match=named):
        assert convert(src, tmp_path / "out.lmdb", progress=False, **options).packed == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_an_image_over_twice_the_decompression_bomb_limit_is_packed_unless_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """A PNG of more pixels than twice PIL.Image.MAX_IMAGE_PIXELS was skipped as 'corrupt image' (a JPEG was
    packed): a genuine large image lost from the pack, called damaged. It is packed as it is (the decoders
    name it, saying to raise the limit), and verify_images skips it as too large to decode."""
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    name = f"cat/big.{fmt.lower()}"
    (src / name).write_bytes(image_bytes(1, fmt=fmt))  # 64x48: 3072 pixels
    (src / "cat/small.png").write_bytes(image_bytes(2, size=(20, 20), fmt="PNG"))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert convert(src, tmp_path / "plain.lmdb", progress=False).packed == 2
    assert LMDBDataset(tmp_path / "plain.lmdb", decode="bytes")[0][0] == (src / name).read_bytes()
    with pytest.warns(Image.DecompressionBombWarning, match=re.escape(f"{name}: Image size (3072 pixels) exceeds")):
        assert convert(src, tmp_path / "small.lmdb", max_side=16, progress=False).packed == 2
    assert LMDBDataset(tmp_path / "small.lmdb", decode="bytes")[0][0] == (src / name).read_bytes()
    result = convert(src, tmp_path / "strict.lmdb", verify_images=True, progress=False)
    assert result.skipped == {"too large to decode": 1}
    assert "raise PIL.Image.MAX_IMAGE_PIXELS where you convert" in result.skip_examples[0]["detail"]


def test_max_side_keeps_the_exif_orientation_and_an_rgb_colour_profile(tmp_path: Path) -> None:
    """A re-encoded JPEG lost its EXIF orientation and ICC profile, which a kept (smaller) one has: a reader that
    applies them turned or coloured images of one pack differently by their size. Both are kept, pixels as stored."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    grey = bytes(16) + b"GRAY" + bytes(108)  # a profile of another colour space: not for an RGB JPEG
    exif = Image.Exif()
    exif[0x0112] = 6  # turn 90 degrees to view
    photo = Image.open(io.BytesIO(image_bytes(1, size=(800, 600))))
    photo.save(src / "a/turned.jpg", exif=exif, icc_profile=srgb)
    photo.convert("L").save(src / "a/grey.jpg", icc_profile=grey)
    assert convert(src, tmp_path / "out.lmdb", max_side=256, progress=False).reencoded == 2
    stored = LMDBDataset(tmp_path / "out.lmdb", decode="bytes")
    with Image.open(io.BytesIO(stored[stored.keys.index("a/turned.jpg")][0])) as turned:
        assert (turned.size, turned.getexif().get(0x0112), turned.info.get("icc_profile")) == ((256, 192), 6, srgb)
    with Image.open(io.BytesIO(stored[stored.keys.index("a/grey.jpg")][0])) as grey_jpeg:
        assert grey_jpeg.size == (256, 192) and "icc_profile" not in grey_jpeg.info


def test_shards_open_with_plain_lmdb_and_document_the_encoding(image_folder: Path, tmp_path: Path) -> None:
    convert(image_folder, tmp_path / "out.lmdb", progress=False)
    env = lmdb.open(str(tmp_path / "out.lmdb/shard-00000.lmdb"), readonly=True, lock=False)
    with env.begin() as txn:
        assert txn.stat()["entries"] == 19
        sample = decode_record(txn.get(encode_key(0)))
    env.close()
    assert sample.key == "cat/a.jpg" and sample.label == 0
    assert sample.data == (image_folder / "cat/a.jpg").read_bytes()


@pytest.mark.skipif(shutil.which("mdb_stat") is None, reason="mdb_stat (lmdb-utils) is not installed")
def test_shards_open_with_mdb_stat(image_folder: Path, tmp_path: Path) -> None:
    convert(image_folder, tmp_path / "out.lmdb", progress=False)
    out = subprocess.run(
        ["mdb_stat", str(tmp_path / "out.lmdb/shard-00000.lmdb")], capture_output=True, text=True, check=True
    ).stdout
    assert "Entries: 19" in out


def test_refuses_existing_destination_without_overwrite(image_folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out.lmdb"
    convert(image_folder, dst, progress=False)
    with pytest.raises(ConfigError, match=r"out\.lmdb: destination already exists.*overwrite=True"):
        convert(image_folder, dst, progress=False)
    (image_folder / "cat" / "a.jpg").unlink()
    assert convert(image_folder, dst, overwrite=True, progress=False).packed == 18
    assert len(LMDBDataset(dst)) == 18


def test_overwrite_never_replaces_something_that_is_not_a_pack(image_folder: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="not a packdata pack; refusing"):
        convert(image_folder, precious, overwrite=True, progress=False)
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_refuses_destination_inside_source(image_folder: Path) -> None:
    with pytest.raises(ConfigError, match="inside the source"):
        convert(image_folder, image_folder / "cat" / "out.lmdb", progress=False)


def test_refuses_a_destination_inside_a_pack(image_folder: Path, tmp_path: Path) -> None:
    """convert SRC p.lmdb/x.lmdb wrote a pack into another's folder, whose --overwrite then refused the foreign
    entry (merge and export already refused such an output)."""
    convert(image_folder, tmp_path / "p.lmdb", progress=False)
    before = sorted(p.name for p in (tmp_path / "p.lmdb").iterdir())
    for inner in (tmp_path / "p.lmdb" / "x.lmdb", tmp_path / "p.lmdb" / "index" / "y.tfrecord"):
        with pytest.raises(ConfigError, match=r"the pack would be inside the pack .*p\.lmdb"):
            convert(image_folder, inner, progress=False)
    assert sorted(p.name for p in (tmp_path / "p.lmdb").iterdir()) == before
    convert(image_folder, tmp_path / "p.lmdb", overwrite=True, progress=False)


def test_refuses_missing_and_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"nope: no such folder"):
        convert(tmp_path / "nope", tmp_path / "out.lmdb", progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match=r"empty: no image or text files found"):
        convert(tmp_path / "empty", tmp_path / "out.lmdb", progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk/x.jpg").write_bytes(b"junk")
    with pytest.raises(SourceError, match=r"no usable image files \(skipped: 1 corrupt image\)"):
        convert(tmp_path / "junk", tmp_path / "out.lmdb", progress=False)
    assert not (tmp_path / "out.lmdb").exists() and not partial_path(tmp_path / "out.lmdb").exists()


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_pack_given_as_the_source_is_refused_not_packed_as_files(
    image_folder: Path, tmp_path: Path, fmt: str
) -> None:
    """'convert train.lmdb train --format tfrecord' packed manifest.json and the index as text samples, exit 0."""
    pack = tmp_path / "p"
    convert(image_folder, pack, format=fmt, progress=False)
    dst = tmp_path / "again"
    result = CliRunner().invoke(main, ["convert", str(pack), str(dst), "--format", "lmdb", "-q"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {pack}: is a packdata pack, not a folder of files to pack. To repack it (another format or shard "
        f"size), export it first (`packdata export {pack} DIR`), then convert DIR\n"
    )
    assert not dst.exists()
    own = tmp_path / "own"  # a folder that merely holds a manifest.json of its own is packed as usual
    (own / "docs").mkdir(parents=True)
    (own / "manifest.json").write_text('{"files": 1}')
    (own / "docs" / "a.txt").write_text("alpha")
    assert convert(own, tmp_path / "own.lmdb", progress=False).packed == 2


def test_decoded_images_are_rgb(image_folder: Path, tmp_path: Path) -> None:
    convert(image_folder, tmp_path / "out.lmdb", progress=False)
    img, label = LMDBDataset(tmp_path / "out.lmdb")[0]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (64, 48) and label == 0


def test_jpeg_with_a_damaged_header_is_skipped_without_verify(image_folder: Path, tmp_path: Path) -> None:
    whole = image_bytes(3, size=(128, 96))
    (image_folder / "cat" / "fake.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    (image_folder / "cat" / "headless.jpg").write_bytes(whole[:40])  # cut inside the header
    (image_folder / "cat" / "tail.jpg").write_bytes(whole + b"\0" * 100)  # trailing bytes: still valid
    result = convert(image_folder, tmp_path / "out.lmdb", progress=False)
    assert result.skipped == {"corrupt image": 2}
    assert {e["key"] for e in result.skip_examples} == {"cat/fake.jpg", "cat/headless.jpg"}


@pytest.mark.parametrize("verify_images", [False, True])
def test_an_image_of_a_few_bytes_is_skipped_as_corrupt(image_folder: Path, tmp_path: Path, verify_images: bool) -> None:
    """Under 4 bytes, PIL's other plug-ins' signature tests read past the data (struct.error): still a skip."""
    for name, data in (("two.png", b"\x89P"), ("bm.bmp", b"BM"), ("three.gif", b"GIF")):
        (image_folder / "cat" / name).write_bytes(data)
    args = ["convert", str(image_folder), str(tmp_path / "out.lmdb"), *(["--verify-images"] if verify_images else [])]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "SKIPPED 3 files: 3 corrupt image" in result.output
    assert "cat/two.png: corrupt image: not an image in a known format" in result.output
    assert len(LMDBDataset(tmp_path / "out.lmdb")) == 19


@pytest.mark.root
def test_full_disk_gives_one_clear_error_and_resumes_after_space_is_freed(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    src = tmp_path / "src"
    (src / "docs").mkdir(parents=True)
    for i in range(120):
        (src / f"docs/{i:03d}.txt").write_text(f"document {i} " * 5000)  # about 60 KB each, 7 MB in all
    before = tree_digest(src)
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(disk)], check=True)
    try:
        full = rf"no space left on {re.escape(str(disk))} \(tmpfs of 3\.0 MiB, .*\)\. Free space .* resume=True"
        with pytest.raises(CapacityError, match=full):  # a shard's commit or another write (the index): both named
            convert(src, disk / "out.lmdb", progress=False)
        assert not (disk / "out.lmdb").exists()
        subprocess.run(["mount", "-o", "remount,size=64M", str(disk)], check=True)
        result = convert(src, disk / "out.lmdb", resume=True, progress=False)
        assert result.packed == 120
        verify_pack(disk / "out.lmdb", progress=False)
        assert tree_digest(src) == before
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)  # lazy: this process still maps the shard


@pytest.mark.parametrize("option", [{"kind": "bogus"}, {"format": "bogus"}, {"on_error": "bogus"}, {"engine": "bogus"}])
def test_bad_options_are_one_config_error_that_is_also_a_value_error(
    image_folder: Path, tmp_path: Path, option: dict[str, str]
) -> None:
    name = next(iter(option))
    with pytest.raises(ConfigError, match=rf"{name} should be .*but got {name}='bogus'") as raised:
        convert(image_folder, tmp_path / "out.lmdb", progress=False, **option)
    assert isinstance(raised.value, ValueError)
    assert not (tmp_path / "out.lmdb").exists()


def test_reads_in_flight_follow_what_pays() -> None:
    """The read pipeline keeps the chunks in flight (0: none, the caller reads) that gave the most chunks a second."""
    from packdata.conversion.pool_map import _InFlight

    now = [0.0]

    def run(
        seconds_per_chunk: Callable[[int], float], item_seconds: float | Callable[[int], float], windows: int = 60
    ) -> list[int]:
        in_flight = _InFlight(16, window=4, patience=3, clock=lambda: now[0])
        limits = []
        for chunk in range(windows * in_flight.window):
            now[0] += seconds_per_chunk(in_flight.limit)
            in_flight.done(item_seconds(chunk) if callable(item_seconds) else item_seconds)
            limits.append(in_flight.limit)
        return limits[:: in_flight.window]  # the limit of each window

    def slow_storage(limit: int) -> float:
        return 1.0 / max(limit, 1)  # each doubling halves the time; none reads one item at a time

    waits = run(slow_storage, item_seconds=0.005)  # items that wait 5 ms: none is never tried
    assert waits[:4] == [2, 4, 8, 16] and set(waits[4:]) == {16}  # a doubling a window while each pays
    cheap = run(slow_storage, item_seconds=50e-6)  # cheap items, yet more in flight pays: none tried ever less often
    assert cheap.index(16) <= 10 and cheap[-5:] == [16] * 5
    tries = [i for i, limit in enumerate(cheap) if limit == 0]
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert len(tries) == 5 and gaps == sorted(gaps) and gaps[-1] >= 3 * gaps[0]
    warm_cache = run(lambda limit: 1.0 + 0.1 * limit, item_seconds=50e-6)  # threads only take the GIL: none fastest
    assert set(warm_cache) == {0, 2} and warm_cache[2:].count(0) >= 40  # none kept, threads tried now and then
    chunks = itertools.count()
    cold_from = 80  # a warm first part of the source (none is fastest), then a cold one (threads pay)

    def warm_then_cold(limit: int) -> float:
        return 1.0 + 0.1 * limit if next(chunks) < cold_from else 1.0 / max(limit, 1)

    turns_cold = run(warm_then_cold, lambda chunk: 50e-6 if chunk < cold_from else 0.005, windows=40)
    assert turns_cold[20:25] == [0, 2, 4, 8, 16]  # threads as soon as a window is slow, then a doubling a window
    two_best = run(lambda limit: {0: 1.0, 2: 0.5}.get(limit, 0.6), item_seconds=50e-6)
    assert set(two_best) == {0, 2, 4} and two_best.count(2) >= 40  # 2 kept; 4 and none tried, never kept
    assert _InFlight(1).limit == 1


def test_ordered_map_runs_chunks_in_the_pool_or_in_the_callers_thread_in_order(monkeypatch) -> None:
    """Whatever the limit does (none, 2, 4 in flight), results come in input order, each chunk where it was run."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import packdata.conversion.pool_map as pool_map

    class Cycling(pool_map._InFlight):
        def __init__(self, most: int) -> None:
            super().__init__(most)
            self._schedule = iter([2, 0, 0, 4, 0, 2, 2, 0] * 100)
            self.limit = next(self._schedule)

        def done(self, item_seconds: float = 0.0) -> None:
            self.limit = next(self._schedule)

    monkeypatch.setattr(pool_map, "_InFlight", Cycling)

    def where(x: int) -> tuple[int, str]:
        if x == 500:
            raise ValueError("item 500")
        return 2 * x, threading.current_thread().name

    got = []
    with ThreadPoolExecutor(4, thread_name_prefix="pool") as pool, pytest.raises(ValueError, match="item 500"):
        for item, result in pool_map.ordered_map(where, iter(range(1000)), pool, depth=8, chunk=10):
            got.append((item, result))
    assert [item for item, _ in got] == list(range(500))  # every item before the failing chunk's, in order
    assert all(result == 2 * item for item, (result, _) in got)
    threads = {name for _, (_, name) in got}
    assert threading.current_thread().name in threads and any(name.startswith("pool") for name in threads)


def test_a_checkpoint_snapshot_does_not_follow_later_skips_or_fields(tmp_path: Path) -> None:
    """A closed shard's checkpoint is taken at hand-off and saved later: skips and fields met since stay out of it."""
    from packdata.conversion.checkpoint import _Checkpoint

    checkpoint = _Checkpoint(tmp_path / "progress.json", {})
    snapshot = checkpoint.state()
    checkpoint.skip_examples.append({"key": "later", "reason": "corrupt image", "detail": ""})
    checkpoint.field_names.append("json")
    checkpoint.skipped["corrupt image"] += 1
    checkpoint.save(snapshot)
    saved = json.loads((tmp_path / "progress.json").read_text())
    assert saved["skip_examples"] == [] and saved["field_names"] == [] and saved["skipped"] == {}


_KILLED_OVERWRITE = r"""
import os, signal, sys
import packdata
src, dst, event = sys.argv[1:]

def hook(name, args):  # SIGKILL right before the rename of the new pack into place, or the old pack's deletion
    if name == event and (name != "os.rename" or os.fspath(args[1]) == dst):
        os.kill(os.getpid(), signal.SIGKILL)

sys.addaudithook(hook)
packdata.convert(src, dst, overwrite=True, progress=False)
"""


def _hidden(dst: Path) -> list[str]:
    return sorted(name for name in os.listdir(dst.parent) if name.startswith(f".{dst.name}.old-"))


@pytest.mark.parametrize("event", ["os.rename", "shutil.rmtree"])
def test_an_overwrite_killed_while_replacing_the_pack_loses_neither_pack_nor_leaves_one(
    tmp_path: Path, event: str
) -> None:
    """Killed between its two renames, the old pack comes back; killed while deleting it, its rest goes.

    An overwrite moves the old pack aside as .NAME.old-PID and deletes it once the new one has the name:
    a kill between the renames left no pack at DST (the old one hidden for good), a kill in the deletion
    left a half-deleted copy, and no later run removed either.
    """
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    for src, n in ((old_src, 2), (new_src, 3)):
        (src / "cat").mkdir(parents=True)
        for i in range(n):
            (src / "cat" / f"{src.name}{i}.jpg").write_bytes(image_bytes(i + 10 * n))
    dst = tmp_path / "p.lmdb"
    convert(old_src, dst, progress=False)
    done = subprocess.run([sys.executable, "-c", _KILLED_OVERWRITE, str(new_src), str(dst), event], timeout=120)
    assert done.returncode == -signal.SIGKILL
    assert len(_hidden(dst)) == 1 and os.path.exists(dst) == (event == "shutil.rmtree")
    if event == "os.rename":  # no pack at DST: the next run puts the old one back, and refuses to replace it
        with pytest.raises(ConfigError, match="already exists"):
            convert(new_src, dst, progress=False)
        assert list(LMDBDataset(dst).keys) == ["cat/old0.jpg", "cat/old1.jpg"] and _hidden(dst) == []
    convert(new_src, dst, overwrite=True, progress=False)
    assert list(LMDBDataset(dst).keys) == ["cat/new0.jpg", "cat/new1.jpg", "cat/new2.jpg"] and _hidden(dst) == []
    assert verify_pack(dst, progress=False).records == 3


def test_planted_old_siblings_are_never_followed_or_restored(tmp_path: Path) -> None:
    """A link named .NAME.old-PID to a pack elsewhere, and a FIFO so named: removed as themselves, never moved in."""
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "a.jpg").write_bytes(image_bytes(1))
    outside = tmp_path / "elsewhere" / "theirs.lmdb"
    outside.parent.mkdir()
    convert(src, outside, progress=False)
    around = tree_digest(outside)
    dst = tmp_path / "p.lmdb"
    (tmp_path / ".p.lmdb.old-1").symlink_to(outside)
    os.mkfifo(tmp_path / ".p.lmdb.old-2-1")
    convert(src, dst, progress=False)
    assert not dst.is_symlink() and list(LMDBDataset(dst).keys) == ["cat/a.jpg"] and _hidden(dst) == []
    assert tree_digest(outside) == around


def test_the_walks_extension_and_hidden_tests_agree_with_splitext_and_the_parts() -> None:
    """The walk's string searches stand for os.path.splitext and a test of every part, on every short path."""
    from packdata.conversion.sources import _extension, _is_hidden

    for length in range(1, 7):
        for chars in itertools.product("a./", repeat=length):
            rel = "".join(chars)
            assert _extension(rel) == os.path.splitext(rel.rsplit("/", 1)[-1])[1].lower(), rel
            assert _is_hidden(rel) == any(part.startswith(".") for part in rel.split("/")), rel
    assert _extension("class0/IMG.JPEG") == ".jpeg"


@pytest.mark.parametrize("limit", ["shard_samples", "shard_size"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
def test_a_shard_limit_that_is_not_a_whole_number_from_1_is_refused_before_anything_is_made(
    tmp_path: Path, limit: str, value: object
) -> None:
    """The CLI refused them, the Python API did not: shard_samples=0 and True packed one sample per shard or every
    sample in one, -1 a shard per sample, 1.5 made odd shards; a string was compared with numbers mid-run."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"{i}.txt").write_text(f"t{i}", encoding="utf-8")
    message = re.escape(f"{limit} should be a whole number >= 1 (or None), but got {limit}={value!r}")
    with pytest.raises(ConfigError, match=message):
        convert(src, tmp_path / "out.lmdb", progress=False, **{limit: value})
    if not isinstance(value, str):  # PackWriter parses a size given as text
        with pytest.raises(ConfigError, match=message):
            PackWriter(tmp_path / "w.lmdb", **{limit: value})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


_POOL_SIZES = """
import concurrent.futures, json, os, sys
from packdata import convert, write_pack
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this process may run on one CPU of the host's
sizes = {}
real_init = concurrent.futures.ThreadPoolExecutor.__init__
def init(self, max_workers=None, thread_name_prefix="", *args, **kwargs):  # the real pool, its size noted
    sizes[thread_name_prefix] = max_workers
    real_init(self, max_workers, thread_name_prefix, *args, **kwargs)
concurrent.futures.ThreadPoolExecutor.__init__ = init
convert(sys.argv[1], os.path.join(sys.argv[2], "a.lmdb"), progress=False)
write_pack([{"__key__": str(i), "bin": b"x"} for i in range(4)], os.path.join(sys.argv[2], "b.lmdb"), progress=False)
print(json.dumps(sizes))
"""


def test_default_read_threads_follow_the_cpus_the_process_may_use_not_the_hosts(
    image_folder: Path, tmp_path: Path
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 CPUs to allow the conversion fewer")
    done = subprocess.run(
        [sys.executable, "-c", _POOL_SIZES, str(image_folder), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sizes = json.loads(done.stdout.splitlines()[-1])
    assert sizes["packdata-read"] == 4  # 4 per usable CPU: 1 allowed, whatever the host has
    assert sizes["packdata-encode"] == 1


@pytest.mark.parametrize("fmt", ["lmdb", "tfrecord"])
def test_a_conversion_holds_a_few_mib_of_samples_before_its_commit_not_the_commits_128_mib(
    fmt: str, tmp_path: Path
) -> None:
    """Samples reach the shard's writer every few MiB, not all of a 128 MiB commit held, then copied, at once.

    42 MB of 640 two-field samples fit one commit: before, the conversion held
    all of them, and (LMDB) a copy of each as its record, while the writer ran.
    Every sample still comes back byte for byte, in order. One read thread:
    at most two chunks of 16 samples read ahead, whatever the machine.
    """
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(7)
    expected = {}
    for n in range(640):
        blob, caption = rng.bytes(64 << 10), f"caption {n}".encode()
        (src / f"{n:04d}.bin").write_bytes(blob)
        (src / f"{n:04d}.txt").write_bytes(caption)
        expected[f"{n:04d}"] = (blob, caption)
    pack = tmp_path / ("out.lmdb" if fmt == "lmdb" else "out")
    tracemalloc.start()
    try:
        result = convert(src, pack, layout="grouped", format=fmt, workers=1, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (result.packed, result.skipped) == (640, {})
    reader = LMDBDataset if fmt == "lmdb" else TFRecordDataset
    options = {} if fmt == "lmdb" else {"shuffle": False}
    got = [(s["__key__"], (bytes(s["bin"]), bytes(s["txt"]))) for s in reader(pack, decode="bytes", **options)]
    assert got == list(expected.items())
    source_bytes = sum(len(b) + len(c) for b, c in expected.values())
    assert peak < source_bytes / 2, f"{peak:,} bytes held at the peak, for {source_bytes:,} bytes of samples"
