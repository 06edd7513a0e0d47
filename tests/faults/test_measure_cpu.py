"""measure_loader's CPU time per sample is read finely enough to see in-process decoding."""

from __future__ import annotations

import time

from packdata.measure.loop import LoaderConfig, measure_loader
from packdata.measure.sources import InMemoryDataset
from packdata.reading.loader import list_collate


def _burn_half_a_millisecond(data: bytes) -> bytes:
    end = time.process_time() + 0.0005
    while time.process_time() < end:
        pass
    return data


def test_in_process_cpu_time_is_not_rounded_to_clock_ticks() -> None:
    dataset = InMemoryDataset([(bytes([i]) * 100, i) for i in range(8)], decode=_burn_half_a_millisecond)
    result = measure_loader(
        dataset, LoaderConfig(0, 4), batches=1, warmup=0, collate_fn=list_collate, sample_interval=60
    )
    # 4 samples x 0.5 ms of CPU: psutil's 10 ms ticks would read 0 or 2.5 ms per sample
    assert result.samples == 4
    assert 0.4 <= result.cpu_ms_per_sample <= 2.0, result.cpu_ms_per_sample
