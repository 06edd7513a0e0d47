"""Multi-field sources refused or skipped: grouped folders, npy and JSON files, samples over the limit, locales."""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import image_bytes
from fields_helpers import _convert_in_an_ascii_locale
from torch.utils.data import DataLoader

import packdata
from packdata.errors import ConfigError


def test_a_group_split_by_a_subfolder_named_like_it_is_one_sample(tmp_path: Path) -> None:
    """a.bin, then the folder a.d/ (sorted between them), then a.json: once two samples keyed 'a', one field each."""
    src = tmp_path / "src"
    (src / "a.d").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"\x00\x01")
    (src / "a.d" / "x.txt").write_text("inside", encoding="utf-8")
    (src / "a.d" / "x.json").write_text("[2]", encoding="utf-8")
    (src / "a.json").write_text("[1]", encoding="utf-8")
    (src / "b.json").write_text("[3]", encoding="utf-8")
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert (result.found, result.packed, result.skipped) == (3, 3, {})
    samples = {s["__key__"]: s for s in packdata.LMDBDataset(tmp_path / "out.lmdb", decode="bytes")}
    assert sorted(samples) == ["a", "a.d/x", "b"]
    assert (bytes(samples["a"]["bin"]), bytes(samples["a"]["json"])) == (b"\x00\x01", b"[1]")
    assert (bytes(samples["a.d/x"]["txt"]), bytes(samples["a.d/x"]["json"])) == (b"inside", b"[2]")


def test_a_pickled_npy_file_is_never_loaded(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("ok", encoding="utf-8")
    with open(src / "a.npy", "wb") as f:
        np.save(f, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    (src / "b.txt").write_text("fine", encoding="utf-8")
    (src / "b.npy").write_bytes(_npy(np.ones(3)))
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.skipped == {"not npy": 1}
    assert np.array_equal(packdata.LMDBDataset(tmp_path / "out.lmdb")[0]["npy"], np.ones(3))


def test_a_source_json_nested_past_the_parser_is_skipped_not_a_traceback(tmp_path: Path) -> None:
    """Convert's check of a .json let json.loads's RecursionError out: the whole conversion died with a traceback."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("deep", encoding="utf-8")
    (src / "a.json").write_text("[" * 100_000, encoding="utf-8")
    (src / "b.txt").write_text("flat", encoding="utf-8")
    (src / "b.json").write_text("[1]", encoding="utf-8")
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.skipped == {"not JSON": 1}
    assert result.skip_examples[0]["detail"] == "field 'json': nested deeper than the JSON parser goes"
    assert [s["json"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == [[1]]


@pytest.mark.parametrize("descr", ["|S0", "|V0", "<U0", []])
def test_an_npy_of_zero_byte_elements_is_refused_past_one_element_a_byte(tmp_path: Path, descr: object) -> None:
    """A header alone declared 10**18 elements of 0 bytes: checked sound, np.load gave an array no loop finishes."""
    from numpy.lib import format as npy_format

    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": (10**18,)})
    huge = header.getvalue()
    problem = "its header's shape (1000000000000000000,) holds 1000000000000000000 elements of 0 bytes"
    small = _npy(np.zeros(4, dtype=("f8", (0,))))  # numpy writes this: 4 elements of 0 bytes (|V0), 128 bytes
    pack = tmp_path / "p.lmdb"
    packdata.write_pack([{"__key__": "huge", "npy": huge}, {"__key__": "small", "npy": small}], pack, progress=False)
    named = f"sample 'huge' (index 0), field 'npy': .npy array cannot be read ({problem}"
    with pytest.raises(packdata.DecodeError, match=re.escape(named)):
        packdata.LMDBDataset(pack)[0]
    assert packdata.LMDBDataset(pack)[1]["npy"].shape == (4,)
    src = tmp_path / "src"
    src.mkdir()
    for key, data in [("huge", huge), ("small", small)]:
        (src / f"{key}.txt").write_text(key, encoding="utf-8")
        (src / f"{key}.npy").write_bytes(data)
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.skipped == {"not npy": 1} and result.skip_examples[0]["detail"].startswith(f"field 'npy': {problem}")
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "out.lmdb")] == ["small"]


def _npy(array: np.ndarray) -> bytes:
    import io

    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def test_a_file_or_tar_member_over_the_sample_limit_is_skipped_unread(tmp_path: Path) -> None:
    """A sample over 2 GiB fits no Example protobuf parses (nor, over 4 GiB, an LMDB value): skipped, never read."""
    import resource

    from packdata.pack.records import MAX_SAMPLE_BYTES

    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("alpha", encoding="utf-8")
    with open(texts / "huge.txt", "wb") as f:
        f.truncate(MAX_SAMPLE_BYTES + 1)  # sparse: nothing is written
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = packdata.convert(texts, tmp_path / "texts.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert (
        result.skip_examples[0]["detail"]
        == f"{MAX_SAMPLE_BYTES + 1} bytes; a sample holds at most {MAX_SAMPLE_BYTES} (2 GiB less 1 MiB)"
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 512 * 1024  # KiB: the file was never read

    out = io.BytesIO()  # a member whose header claims more than the limit, then the tar ends: named, never read
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("ok.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    header = tarfile.TarInfo("big.txt")
    header.size = MAX_SAMPLE_BYTES + 1
    (tmp_path / "data.tar").write_bytes(out.getvalue()[:1024] + header.tobuf())
    result = packdata.convert(str(tmp_path / "data.tar"), tmp_path / "tar.lmdb", progress=False, on_error="skip")
    assert result.packed == 1 and result.skipped == {"corrupt tar": 1}
    claim = f"member 'big.txt' claims {MAX_SAMPLE_BYTES + 1} bytes, past the tar's end (byte 1536)"
    assert result.skip_examples[0]["detail"].startswith(claim)


def test_pack_writer_and_list_groups_refuse_a_sample_over_the_limit(tmp_path: Path, monkeypatch) -> None:
    """The limit is checked on the whole encoded sample too (a group of files, an object read whole, write_pack)."""
    from packdata.conversion import load, writer

    monkeypatch.setattr(writer, "MAX_SAMPLE_BYTES", 100)
    with packdata.PackWriter(tmp_path / "w.lmdb") as pack:
        with pytest.raises(ConfigError, match=r"sample 'big' is \d+ bytes; a sample holds at most 100"):
            pack.write({"__key__": "big", "txt": "x" * 200})
        pack.write({"__key__": "small", "txt": "fits"})
    assert [s["__key__"] for s in packdata.LMDBDataset(tmp_path / "w.lmdb")] == ["small"]

    monkeypatch.setattr(load, "MAX_SAMPLE_BYTES", 100)
    for name, text in (("a.txt", "x" * 60), ("b.txt", "fits")):  # each file under the limit: the block over it
        (tmp_path / name).write_text(text, encoding="utf-8")
    (tmp_path / "l.csv").write_text(f"path,caption\na.txt,{'y' * 60}\nb.txt,short\n", encoding="utf-8")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "l.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"too large": 1}
    assert result.skip_examples[0]["key"] == "a"


def test_a_source_npy_whose_header_claims_a_huge_array_is_skipped_unallocated(tmp_path: Path) -> None:
    """Convert checked a .npy with np.load, which allocates the declared shape first: 80 GB from a 200-byte file."""
    from numpy.lib import format as npy_format

    header = io.BytesIO()
    npy_format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (10**10,)})
    (tmp_path / "a.npy").write_bytes(header.getvalue() + bytes(64))
    good = io.BytesIO()
    np.save(good, np.arange(3))
    (tmp_path / "b.npy").write_bytes(good.getvalue())
    (tmp_path / "l.csv").write_text("path\na.npy\nb.npy\n", encoding="utf-8")
    result = packdata.convert(tmp_path / "l.csv", tmp_path / "out.lmdb", progress=False)
    assert result.packed == 1 and result.skipped == {"not npy": 1}
    detail = "field 'npy': its header asks for 80000000000 bytes of array data, 64 follow"
    assert result.skip_examples[0]["detail"] == detail
    assert np.array_equal(packdata.LMDBDataset(tmp_path / "out.lmdb")[0]["npy"], np.arange(3))


def test_grouped_field_names_are_lower_cased_and_two_files_of_one_field_skip_the_sample(tmp_path: Path) -> None:
    """IMG_1.JPG gave field 'JPG' where IMG_2.jpg gave 'jpg': fields=("jpg", "txt") raised a KeyError in a worker
    mid-epoch, and c.jpg beside c.JPG packed both images as two fields. Fields are now lower-cased, as tars'
    and lists' are (and WebDataset's), and two files of one field skip their sample, naming both."""
    src = tmp_path / "src"
    src.mkdir()
    files = {"IMG_1.JPG": image_bytes(1), "IMG_2.jpg": image_bytes(2), "c.jpg": image_bytes(3), "c.JPG": image_bytes(4)}
    files |= {"IMG_1.TXT": b"one", "IMG_2.txt": b"two", "c.txt": b"three"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert result.packed == 2 and result.skipped == {"duplicate field": 1}
    detail = "files c.JPG and c.jpg both give field 'jpg'"
    assert result.skip_examples == [{"key": "c", "reason": "duplicate field", "detail": detail}]
    ds = packdata.LMDBDataset(tmp_path / "out.lmdb", fields=("__key__", "jpg", "txt"), decode={"jpg": "bytes"})
    got = [(key, bytes(jpg), txt) for key, jpg, txt in DataLoader(ds, batch_size=None, num_workers=2)]
    assert got == [("IMG_1", files["IMG_1.JPG"], "one"), ("IMG_2", files["IMG_2.jpg"], "two")]


def test_require_names_a_grouped_field_in_the_case_of_its_files(tmp_path: Path) -> None:
    """Grouped fields are lower-cased: --require JPG,TXT (as the camera's files are named) then matched no field,
    and every sample was a 'missing field' skip. Required names are lower-cased as the fields are."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "IMG_1.JPG").write_bytes(image_bytes(1))
    (src / "IMG_1.TXT").write_text("one", encoding="utf-8")
    (src / "IMG_2.JPG").write_bytes(image_bytes(2))
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", require=("JPG", "TXT"), progress=False)
    assert result.packed == 1 and result.skipped == {"missing field": 1}
    assert result.skip_examples[0]["detail"] == "no txt file (required: jpg, txt)"


@pytest.mark.parametrize("layout", ["classes", "grouped"])
def test_a_folder_gives_the_same_keys_and_classes_whatever_the_locale(tmp_path: Path, layout: str) -> None:
    """Python decodes file names in the locale's encoding: under ASCII, cafés/ü.txt was a 'name not UTF-8' skip
    (and its folder no class); under Latin-1 its key was cafÃ©s/Ã¼. Names are now read as UTF-8 everywhere."""
    src = tmp_path / "src"
    for folder in ("cafés", "plain"):
        (src / folder).mkdir(parents=True)
        for stem in ("ü", "a"):
            (src / folder / f"{stem}.txt").write_text(f"{folder} {stem}", encoding="utf-8")
            if layout == "grouped":
                (src / folder / f"{stem}.json").write_text("[1]", encoding="utf-8")
    packdata.convert(src, tmp_path / "utf8.lmdb", progress=False)
    _convert_in_an_ascii_locale(src, tmp_path / "ascii.lmdb")
    utf8, ascii = (packdata.LMDBDataset(tmp_path / f"{name}.lmdb") for name in ("utf8", "ascii"))
    assert ascii.classes == utf8.classes == ["cafés", "plain"]
    assert list(ascii.targets) == list(utf8.targets) == [0, 0, 1, 1]
    keys = [f"{key}{'.txt' * (layout == 'classes')}" for key in ("cafés/a", "cafés/ü", "plain/a", "plain/ü")]
    assert [ascii.keys[i] for i in range(4)] == [utf8.keys[i] for i in range(4)] == keys


def test_a_grouped_file_left_unread_skips_its_sample_not_packed_without_it(tmp_path: Path) -> None:
    """A FIFO b.txt, a file c.cls\\xe9 whose name is not UTF-8 past its key, a file 'd.' with no field name: each was
    skipped alone and its sample packed without that field (b without its caption, c without its label). Each
    sample is skipped whole now, as a tar's with a member left unread."""
    src = tmp_path / "src"
    src.mkdir()
    for key in "abcde":
        (src / f"{key}.json").write_text(json.dumps([key]), encoding="utf-8")
    (src / "a.txt").write_text("a caption", encoding="utf-8")
    os.mkfifo(src / "b.txt")
    try:
        Path(os.fsdecode(os.fsencode(src) + b"/c.cls\xe9")).write_text("3", encoding="utf-8")
    except OSError:
        pytest.skip("filesystem refuses non-UTF-8 names")
    (src / "d.").write_text("no field", encoding="utf-8")
    (src / "e.txt").write_text("e caption", encoding="utf-8")
    (src / "e.d").mkdir()  # a folder beside group e: no file of it (its files are group e.d/x's)
    (src / "e.d" / "x.txt").write_text("x caption", encoding="utf-8")
    result = packdata.convert(src, tmp_path / "out.lmdb", layout="grouped", progress=False)
    assert (result.found, result.packed) == (6, 3)
    assert result.skipped == {"not a regular file": 1, "name not UTF-8": 1, "bad field name": 1}
    details = {e["key"]: e["detail"] for e in result.skip_examples}
    assert details == {
        "b": "file 'b.txt' (a FIFO) is left unread: the sample is skipped whole",
        "c": "file 'c.cls\\xe9' is left unread: the sample is skipped whole",
        "d": "file 'd.': a field name should be a non-empty string, but got ''",
    }
    packed = [(s["__key__"], s["txt"]) for s in packdata.LMDBDataset(tmp_path / "out.lmdb")]
    assert packed == [("a", "a caption"), ("e.d/x", "x caption"), ("e", "e caption")]  # e open while e.d/ is walked
