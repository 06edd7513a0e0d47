"""packdata: pack folders of small files into LMDB or TFRecord and feed PyTorch fast.

Names are imported on first use (PEP 562), so ``packdata convert`` and Ray
conversion workers do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Bound eagerly: the ``packdata.convert`` submodule would otherwise shadow the
# function once imported. It is cheap (no torch).
from packdata.convert import convert
from packdata.doctor import DoctorReport, doctor  # same shadowing as convert; no torch
from packdata.stage import StageResult, StageStatus, UnstageResult, prepare_tmpfs, stage, stage_status, unstage

_EXPORTS = {
    "BenchResult": "measure.bench",
    "run_bench": "measure.bench",
    "ConvertResult": "convert",
    "LMDBDataset": "datasets",
    "DecodeJPEG": "decode",
    "CapacityError": "errors",
    "ConfigError": "errors",
    "LockedError": "errors",
    "PackdataError": "errors",
    "PackFormatError": "errors",
    "SourceError": "errors",
    "BackgroundPrefetcher": "loader",
    "CUDAPrefetcher": "loader",
    "fast_collate": "loader",
    "worker_init_fn": "loader",
    "BlockShuffleSampler": "samplers",
    "shuffle_quality": "samplers",
    "TokenBucketSampler": "text",
    "pad_collate": "text",
    "TFRecordDataset": "tfrecord_dataset",
    "TFRecordIndexedDataset": "tfrecord_dataset",
    "standard_transform": "transforms",
    "TuneResult": "measure.tune",
    "recommend_loader_kwargs": "measure.tune",
    "run_tune": "measure.tune",
    "pack_info": "verify",
    "verify_pack": "verify",
}

__all__ = [
    "BackgroundPrefetcher",
    "BenchResult",
    "BlockShuffleSampler",
    "CUDAPrefetcher",
    "CapacityError",
    "ConfigError",
    "ConvertResult",
    "DecodeJPEG",
    "DoctorReport",
    "LMDBDataset",
    "LockedError",
    "PackFormatError",
    "PackdataError",
    "SourceError",
    "StageResult",
    "StageStatus",
    "TFRecordDataset",
    "TFRecordIndexedDataset",
    "TokenBucketSampler",
    "TuneResult",
    "UnstageResult",
    "convert",
    "doctor",
    "fast_collate",
    "pack_info",
    "pad_collate",
    "prepare_tmpfs",
    "recommend_loader_kwargs",
    "run_bench",
    "run_tune",
    "shuffle_quality",
    "stage",
    "stage_status",
    "standard_transform",
    "unstage",
    "verify_pack",
    "worker_init_fn",
    "__version__",
]

if TYPE_CHECKING:
    from packdata.convert import ConvertResult
    from packdata.datasets import LMDBDataset
    from packdata.decode import DecodeJPEG
    from packdata.errors import (
        CapacityError,
        ConfigError,
        LockedError,
        PackdataError,
        PackFormatError,
        SourceError,
    )
    from packdata.loader import BackgroundPrefetcher, CUDAPrefetcher, fast_collate, worker_init_fn
    from packdata.measure.bench import BenchResult, run_bench
    from packdata.measure.tune import TuneResult, recommend_loader_kwargs, run_tune
    from packdata.samplers import BlockShuffleSampler, shuffle_quality
    from packdata.text import TokenBucketSampler, pad_collate
    from packdata.tfrecord_dataset import TFRecordDataset, TFRecordIndexedDataset
    from packdata.transforms import standard_transform
    from packdata.verify import pack_info, verify_pack


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'packdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"packdata.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
