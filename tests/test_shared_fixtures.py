"""The shared test machinery of tests/conftest.py itself: what each test leaning on it must be able to rely on."""

from __future__ import annotations

import pytest
from conftest import moto_s3


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
