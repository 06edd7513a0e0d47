"""packdata: pack folders of small files into LMDB or TFRecord and feed PyTorch fast."""

from __future__ import annotations

__version__ = "0.1.0"

from packdata.convert import ConvertResult, convert
from packdata.datasets import LMDBDataset
from packdata.errors import CapacityError, ConfigError, PackdataError, PackFormatError, SourceError
from packdata.verify import pack_info, verify_pack

__all__ = [
    "CapacityError",
    "ConfigError",
    "ConvertResult",
    "LMDBDataset",
    "PackFormatError",
    "PackdataError",
    "SourceError",
    "__version__",
    "convert",
    "pack_info",
    "verify_pack",
]
