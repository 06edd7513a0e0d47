"""packdata: pack folders of small files into LMDB or TFRecord and feed PyTorch fast.

Quickstart::

    # shell: packdata convert ./imagenet/train train.lmdb
    import packdata
    from torch.utils.data import DataLoader

    train = packdata.LMDBDataset("train.lmdb", transform=my_transform)   # where ImageFolder was
    loader = DataLoader(train, batch_size=256, shuffle=True, num_workers=8, persistent_workers=True)

    packdata.convert("./captions", "caps.lmdb", layout="grouped")        # image + caption + json samples
    caps = packdata.LMDBDataset("caps.lmdb", fields=("jpg", "txt"))      # -> (PIL image, str)

``packdata --help`` lists the commands (convert, stage, bench, tune, doctor, ls, cat, export, merge).

Every public name loads on first use (PEP 562): ``import packdata`` imports no
torch, PIL, numpy, lmdb or psutil, so the CLI and Ray conversion workers start
fast. ``_EXPORTS`` is the one list of public names (name -> module).
"""

from __future__ import annotations

import importlib
from typing import Any

from packdata._version import __version__

_EXPORTS = {
    "CapacityError": "errors",
    "ConfigError": "errors",
    "DecodeError": "errors",
    "EngineError": "errors",
    "ImageFormatError": "errors",
    "LockedError": "errors",
    "MissingFieldError": "errors",
    "PackdataError": "errors",
    "PackFormatError": "errors",
    "RankMismatchError": "errors",
    "SourceError": "errors",
    "ConvertResult": "conversion.publish",
    "convert": "conversion.convert",
    "PackWriter": "conversion.writer",
    "write_pack": "conversion.writer",
    "merge_packs": "conversion.combine",
    "pack_info": "formats.verify",
    "verify_pack": "formats.verify",
    "LMDBDataset": "reading.datasets",
    "TFRecordDataset": "reading.streaming",
    "TFRecordIndexedDataset": "reading.tfrecord_indexed",
    "BlockShuffleSampler": "reading.samplers",
    "shuffle_quality": "reading.samplers",
    "check_same_pack": "reading.ranks",
    "DecodeJPEG": "reading.decode",
    "DecodeCrop": "reading.crop",
    "standard_transform": "reading.transforms",
    "BackgroundPrefetcher": "reading.loader",
    "CUDAPrefetcher": "reading.loader",
    "fast_collate": "reading.loader",
    "FieldsCollate": "reading.loader",
    "fields_collate": "reading.loader",
    "worker_init_fn": "reading.loader",
    "TokenBucketSampler": "reading.text",
    "pad_collate": "reading.text",
    "StageResult": "staging.result",
    "StageStatus": "staging.status",
    "UnstageResult": "staging.unstage",
    "prepare_tmpfs": "staging.tmpfs",
    "stage": "staging.stage",
    "stage_status": "staging.status",
    "unstage": "staging.unstage",
    "DoctorReport": "staging.doctor",
    "doctor": "staging.doctor",
    "BenchResult": "measure.bench",
    "run_bench": "measure.bench",
    "TuneResult": "measure.tune",
    "recommend_loader_kwargs": "measure.tune",
    "run_tune": "measure.tune",
    "monitor": "watch.loop",
    "AdaptiveLoader": "watch.adaptive",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'packdata' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"packdata.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
