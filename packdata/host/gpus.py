"""The machine's CUDA devices and their memory: through NVML where ``pynvml`` imports, else ``torch.cuda``.

:func:`nvml_gpus` never initialises CUDA (the monitor samples GPUs from outside a
job); :func:`gpus` falls back to torch, imported only then, and never raises.
:func:`~packdata.host.facts.gather_facts` records them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

__all__ = ["GPUInfo", "gpus", "nvml_gpus"]


@dataclass(frozen=True)
class GPUInfo:
    """One CUDA device and its memory, in bytes."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    utilization: float | None = None  # share of the last sample period the GPU was busy (NVML only)


def nvml_gpus() -> list[GPUInfo] | None:
    """CUDA devices with memory and utilisation through NVML (``pynvml``); None without it or without a driver.

    Never initialises CUDA in this process (the monitor calls it from outside a job).
    """
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
    except Exception:
        return None  # no pynvml or no driver: let torch try
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name, mem = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            try:
                busy: float | None = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
            except Exception:
                busy = None
            found.append(GPUInfo(i, name, int(mem.total), int(mem.free), busy))
        return found
    finally:
        pynvml.nvmlShutdown()


def _gpus_torch() -> list[GPUInfo]:
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        found.append(GPUInfo(i, torch.cuda.get_device_name(i), int(total), int(free)))
    return found


def gpus() -> list[GPUInfo]:
    """CUDA devices via NVML (``pynvml``) if importable, else ``torch.cuda`` (initialises CUDA), else [].

    Never raises.
    """
    for probe in (nvml_gpus, _gpus_torch):
        with contextlib.suppress(Exception):
            if (found := probe()) is not None:
                return found
    return []
