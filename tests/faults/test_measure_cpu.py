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
    assert result.samples == 4
    # 4 samples x 0.5 ms of CPU, and the loop's own (a few ms, more under load: no upper bound holds): psutil's
    # 10 ms ticks read a whole number of ticks, 0 or 2.5 ms a sample; process_time reads nanoseconds
    ticks = result.cpu_ms_per_sample * result.samples / 10
    assert ticks >= 0.2 and abs(ticks - round(ticks)) > 1e-6, result.cpu_ms_per_sample
