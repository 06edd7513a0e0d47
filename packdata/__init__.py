"""packdata: pack folders of small files into LMDB or TFRecord and feed PyTorch fast."""

from __future__ import annotations

__version__ = "0.1.0"

from packdata.bench import BenchResult, run_bench
from packdata.convert import ConvertResult, convert
from packdata.datasets import LMDBDataset
from packdata.decode import DecodeJPEG
from packdata.errors import CapacityError, ConfigError, PackdataError, PackFormatError, SourceError
from packdata.loader import BackgroundPrefetcher, CUDAPrefetcher, fast_collate, worker_init_fn
from packdata.samplers import BlockShuffleSampler, shuffle_quality
from packdata.text import TokenBucketSampler, pad_collate
from packdata.tfrecord_dataset import TFRecordDataset, TFRecordIndexedDataset
from packdata.transforms import standard_transform
from packdata.tune import TuneResult, recommend_loader_kwargs, tune
from packdata.verify import pack_info, verify_pack

__all__ = [
    "BackgroundPrefetcher",
    "BenchResult",
    "BlockShuffleSampler",
    "CUDAPrefetcher",
    "CapacityError",
    "ConfigError",
    "ConvertResult",
    "DecodeJPEG",
    "LMDBDataset",
    "PackFormatError",
    "PackdataError",
    "SourceError",
    "TFRecordDataset",
    "TFRecordIndexedDataset",
    "TokenBucketSampler",
    "TuneResult",
    "convert",
    "fast_collate",
    "pack_info",
    "pad_collate",
    "recommend_loader_kwargs",
    "run_bench",
    "shuffle_quality",
    "standard_transform",
    "tune",
    "verify_pack",
    "worker_init_fn",
    "__version__",
]
