"""Helpers around ``torch.utils.data.DataLoader`` that make a fast loader pay off.

- :func:`worker_init_fn`: one compute thread per worker, so ``N`` workers on
  ``N`` cores do not each start ``N`` OpenMP/MKL threads (oversubscription
  that makes more workers slower);
- :func:`fast_collate`: stacks ``uint8`` images into one NCHW ``uint8`` tensor
  (4x less to copy and pin than float32; normalise on the device);
- :data:`fields_collate`: batches multi-field samples (dicts) whose fields differ
  from sample to sample;
- :class:`CUDAPrefetcher`: copies the next batch to the GPU on a side stream
  while the current one computes; passes batches through without CUDA;
- :class:`BackgroundPrefetcher`: a thread that keeps the next batches ready.
"""

from __future__ import annotations

import operator
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from packdata.reading.fields import SampleDict
from packdata.reading.transforms import uint8_hwc

__all__ = [
    "BackgroundPrefetcher",
    "CUDAPrefetcher",
    "FieldsCollate",
    "fast_collate",
    "fields_collate",
    "list_collate",
    "worker_init_fn",
]

_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def worker_init_fn(worker_id: int) -> None:
    """Limit a DataLoader worker to one compute thread.

    Pass as ``DataLoader(..., worker_init_fn=packdata.worker_init_fn)``. It
    calls ``torch.set_num_threads(1)`` and sets ``OMP_NUM_THREADS``,
    ``MKL_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` and ``NUMEXPR_NUM_THREADS`` to
    1 in the worker (libraries that start their thread pool later, such as
    OpenCV or numexpr imported by the dataset, read them), and
    ``cv2.setNumThreads(1)`` when OpenCV is already imported. Parallelism
    comes from the workers themselves; the main process keeps its threads.

    Args:
        worker_id: the worker's number (unused; the DataLoader passes it).
    """
    del worker_id
    torch.set_num_threads(1)
    for name in _THREAD_VARIABLES:
        os.environ[name] = "1"
    import sys

    cv2 = sys.modules.get("cv2")
    if cv2 is not None:  # pragma: no cover - OpenCV is not a dependency
        cv2.setNumThreads(1)


def _image_array(sample: Any) -> np.ndarray:
    """A sample as a ``uint8`` HWC array (PIL image, numpy array or CHW tensor)."""
    if isinstance(sample, torch.Tensor):
        if sample.dtype != torch.uint8 or sample.ndim != 3:
            raise TypeError(
                f"fast_collate expects uint8 CHW tensors, but got {sample.dtype} of shape {tuple(sample.shape)}"
            )
        return sample.permute(1, 2, 0).numpy()
    return uint8_hwc(sample, "fast_collate")


def fast_collate(batch: Sequence[tuple[Any, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate ``(image, label)`` pairs into a ``uint8`` NCHW tensor and int64 labels.

    Images are ``uint8`` HWC numpy arrays (see
    :class:`packdata.reading.transforms.ToUint8Array`), PIL images, or ``uint8`` CHW
    tensors, all of one size. Nothing is converted to float on the CPU: a batch
    of 256 images of 224x224 is 38 MB instead of 154 MB to move, pin and copy.
    On the device: ``x = x.float().div_(255).sub_(mean).div_(std)``.

    Args:
        batch: the samples of one batch.

    Returns:
        ``(images, labels)``: a ``(N, C, H, W)`` uint8 tensor and a ``(N,)`` int64 tensor.

    Raises:
        TypeError: a sample is not a uint8 image, or a label not a whole number.
        ValueError: the batch is empty or the images differ in size.
    """
    if not batch:
        raise ValueError("fast_collate got an empty batch")
    first = _image_array(batch[0][0])
    height, width, channels = first.shape
    out = torch.empty((len(batch), channels, height, width), dtype=torch.uint8)
    view = out.numpy()
    for i, (sample, _) in enumerate(batch):
        array = first if i == 0 else _image_array(sample)
        if array.shape != first.shape:
            raise ValueError(
                f"fast_collate needs images of one size, but sample {i} is {array.shape} and sample 0 is {first.shape}"
            )
        view[i] = array.transpose(2, 0, 1)
    return out, label_tensor(batch, "fast_collate")


def list_collate(batch: Sequence[tuple[Any, Any]]) -> tuple[list[Any], torch.Tensor]:
    """Collate ``(sample, label)`` pairs into a list of samples and int64 labels.

    For samples the default collate cannot stack: PIL images, bytes, images of
    different sizes. A label that is not a whole number raises ``TypeError``.
    """
    return [sample for sample, _ in batch], label_tensor(batch, "list_collate")


_ABSENT = object()


class FieldsCollate:
    """Collate multi-field samples read as dicts (``fields=None``) whose fields differ from sample to sample.

    The batch is a dict holding every field any of its samples holds, in the order
    they first appear. A field every sample holds is stacked as torch's default
    collate would when its values can be (tensors or NumPy arrays of one shape and
    numeric dtype, numbers: ``cls`` becomes an int64 tensor) and is otherwise a
    list (keys, text, PIL images, parsed JSON, bytes, arrays of different shapes).
    A field some samples lack is a list holding ``missing`` in their place, so
    ``[v is not None for v in batch["mask"]]`` is its mask. ``packdata.fields_collate``
    is ``FieldsCollate()``; pass it as ``collate_fn``.

    Args:
        missing: what a sample that lacks a field holds in that field's list.
    """

    def __init__(self, missing: Any = None) -> None:
        self.missing = missing

    def __call__(self, batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The batch of ``batch``'s samples.

        Raises:
            TypeError: a sample is not a dict (a dataset read with ``fields=(...)`` gives tuples).
            ValueError: the batch is empty.
        """
        if not batch:
            raise ValueError("fields_collate got an empty batch")
        names: dict[str, None] = {}
        for i, sample in enumerate(batch):
            if not isinstance(sample, Mapping):
                raise TypeError(
                    f"fields_collate collates samples read as dicts (fields=None), but sample {i} is a "
                    f"{type(sample).__name__}: for tuples (fields=(...)) use the default collate or list_collate"
                )
            names.update(dict.fromkeys(sample))
        first = batch[0]  # a pack's dicts: the batch too, its lookup of a field no sample holds naming it
        out: dict[str, Any] = SampleDict({}, first.pack, first.known) if isinstance(first, SampleDict) else {}
        for name in names:
            values = [sample.get(name, _ABSENT) for sample in batch]
            if any(value is _ABSENT for value in values):
                out[name] = [self.missing if value is _ABSENT else value for value in values]
            else:
                out[name] = default_collate(values) if _stackable(values) else values
        return out


fields_collate = FieldsCollate()
"""Collate multi-field dicts whose fields differ: a field some samples lack is a list with None in their place."""


def _stackable(values: list[Any]) -> bool:
    """Whether torch's default collate stacks ``values`` into one tensor: numbers, or arrays of one shape and dtype."""
    first = values[0]
    if not all(type(value) is type(first) for value in values):
        return False
    if isinstance(first, (torch.Tensor, np.ndarray, np.generic)):
        kind = first.dtype.kind if isinstance(first, (np.ndarray, np.generic)) else "f"
        return kind in "biufc" and all(v.shape == first.shape and v.dtype == first.dtype for v in values)
    return type(first) in (bool, int, float)


def label_tensor(batch: Sequence[tuple[Any, Any]], collate: str) -> torch.Tensor:
    """The class labels of ``(sample, label)`` pairs as an int64 tensor.

    Raises:
        TypeError: a label is not a whole number (a float target, a string):
            ``int()`` would truncate 0.7 to 0 silently.
    """
    labels = []
    for i, (_, label) in enumerate(batch):
        try:
            labels.append(operator.index(label))
        except TypeError:
            raise TypeError(
                f"{collate} collates class labels into int64, but sample {i} has label {label!r} "
                f"({type(label).__name__}): for other targets pass a collate_fn of your own"
            ) from None
    return torch.tensor(labels, dtype=torch.int64)


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _record_stream(obj: Any, stream: Any) -> None:
    if isinstance(obj, torch.Tensor):
        obj.record_stream(stream)
    elif isinstance(obj, dict):
        for v in obj.values():
            _record_stream(v, stream)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _record_stream(v, stream)


class CUDAPrefetcher:
    """Copy the next batch host->device on a side CUDA stream while this one computes.

    ``for images, labels in CUDAPrefetcher(loader, "cuda"):`` yields batches
    whose tensors are already on the device. The copy of batch ``i + 1`` is
    issued with ``non_blocking=True`` on a separate stream as soon as batch
    ``i`` is handed out, so it overlaps the training step; it only overlaps
    when the loader pins memory (``pin_memory=True``). Tensors nested in
    tuples, lists and dicts are moved; anything else passes as it is.

    Without CUDA (or with a CPU ``device``) it passes batches through
    unchanged, so the same training script runs on a laptop.

    Args:
        loader: any iterable of batches, normally a DataLoader.
        device: the target device; default ``"cuda"`` when available.
    """

    def __init__(self, loader: Iterable[Any], device: str | torch.device | None = None) -> None:
        self.loader = loader
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda" and torch.cuda.is_available()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if not self.enabled:
            yield from self.loader
            return
        stream = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)

        def start(batch: Any) -> Any:
            with torch.cuda.stream(stream):
                return _to_device(batch, self.device)

        def finish(batch: Any) -> Any:
            current.wait_stream(stream)
            _record_stream(batch, current)
            return batch

        yield from one_ahead(iter(self.loader), start, finish)


def one_ahead(iterator: Iterator[Any], start: Callable[[Any], Any], finish: Callable[[Any], Any]) -> Iterator[Any]:
    """``finish(start(item))`` for each item, item ``i + 1`` started before item ``i`` is handed out.

    An error from ``iterator`` or ``start`` is raised where it happened, after
    every item before it: raised as item ``i + 1`` started, it lost item ``i``.
    """

    def begin() -> Any:
        try:
            return start(next(iterator))
        except StopIteration:
            return _END
        except Exception as exc:
            return _Failure(exc)

    upcoming = begin()
    while upcoming is not _END:
        if isinstance(upcoming, _Failure):
            raise upcoming.exc
        batch = finish(upcoming)
        upcoming = begin()
        yield batch


_END = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class BackgroundPrefetcher:
    """Iterate over ``iterable`` in a background thread, ``depth`` items ahead.

    What ``prefetch_generator.BackgroundGenerator`` does: while the consumer
    works on one item, a daemon thread already produces the next ones (useful
    around a ``DataLoader`` with ``num_workers=0``, a CUDA copy, or any
    generator that releases the GIL). Items come out in order; an exception
    raised by the iterable is raised again in the consumer, at the position
    where it happened. Leaving the loop early stops the thread.

    Each ``iter()`` starts a new thread over a new ``iter(iterable)``.

    Args:
        iterable: what to iterate over.
        depth: how many items to hold ready (at least 1).
    """

    def __init__(self, iterable: Iterable[Any], depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth should be at least 1, but got depth={depth}")
        self.iterable = iterable
        self.depth = depth

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        items: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    items.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for item in self.iterable:
                    if not put(item):
                        return
            except BaseException as exc:
                put(_Failure(exc))
                return
            put(_END)

        thread = threading.Thread(target=produce, name="packdata-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = items.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            stop.set()
            thread.join(timeout=5)
