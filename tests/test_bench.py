"""bench and tune: well-formed, consistent results on a small pack with tiny budgets."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from conftest import help_text, image_bytes

import packdata
from packdata.cli import main as cli_main
from packdata.errors import CapacityError, ConfigError
from packdata.measure.bench import CEILING, run_bench
from packdata.measure.loop import DEFAULT_BATCHES, DEFAULT_MIN_SECONDS, ConfigResult, LoaderConfig, measure_loader
from packdata.measure.memory import _MemorySampler
from packdata.measure.sources import InMemoryDataset, open_source
from packdata.measure.tune import project_memory, recommend_loader_kwargs, run_tune
from packdata.reading.loader import list_collate, worker_init_fn

BATCH = 4
BATCHES = 3


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "images"
    for i in range(30):
        cls = root / f"class{i % 3}"
        cls.mkdir(parents=True, exist_ok=True)
        (cls / f"{i:03d}.jpg").write_bytes(image_bytes(i, (80 + i, 64)))
    return root


@pytest.fixture
def pack(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "images.lmdb"
    packdata.convert(folder, dst, progress=False)
    return dst


def _check_consistent(data: dict) -> None:
    for r in data["results"]:
        assert r["error"] is None, r
        assert r["batches"] == BATCHES
        assert r["samples"] == r["batches"] * r["batch_size"]
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["seconds"])
        assert 0 < r["wait_p50_ms"] <= r["wait_p95_ms"] + 1e-9
        assert r["first_batch_s"] > 0
        # CPU time comes in 10 ms clock ticks: a few prefetched batches can cost "0"
        assert r["cpu_ms_per_sample"] >= 0
        mem = r["memory"]
        assert mem["samples"] >= 1 and mem["main"]["uss_peak"] > 0
        assert mem["total"]["uss_peak"] >= mem["main"]["uss_peak"]
        if r["num_workers"]:
            assert mem["processes_peak"] >= 1 + r["num_workers"]
            assert mem["workers"]["per_worker_uss_peak"] > 0
        assert mem["mem_available_min"] > 0 and mem["swap_growth"] >= 0


def test_bench_json_is_consistent_and_has_the_ceiling(pack: Path, folder: Path, tmp_path: Path) -> None:
    result = run_bench(
        [pack, folder], workers=(0, 2), batch_sizes=(BATCH,), batches=BATCHES, warmup=1, sample_interval=0.05
    )
    data = json.loads(result.to_json(tmp_path / "bench.json"))
    assert json.loads((tmp_path / "bench.json").read_text()) == data
    sources = [r["source"] for r in data["results"]]
    assert sources == [CEILING] * 2 + [str(pack)] * 2 + [str(folder)] * 2
    assert [r["num_workers"] for r in data["results"]] == [0, 2] * 3
    _check_consistent(data)
    assert all(r["cpu_ms_per_sample"] > 0 for r in data["results"] if r["num_workers"] == 0)  # decodes in-process
    ceiling_speed = {r["num_workers"]: r["samples_per_s"] for r in data["results"] if r["source"] == CEILING}
    for r in data["results"]:
        # each source's throughput over the ceiling's at the same setting; the ceiling's own ratio is 1
        assert r["vs_ceiling"] == pytest.approx(r["samples_per_s"] / ceiling_speed[r["num_workers"]])
        assert r["vs_ceiling"] > 0
    facts = {s["name"]: s for s in data["sources"]}
    assert facts[CEILING]["from"] == str(pack) and facts[CEILING]["samples"] == 30
    assert facts[str(pack)]["format"] == "lmdb" and facts[str(folder)]["format"] == "folder"
    assert facts[str(pack)]["mean_bytes"] == pytest.approx(facts[str(folder)]["mean_bytes"])
    assert "ceiling" in result.table()


def test_the_ceiling_runs_epochs_as_long_as_its_source(pack: Path) -> None:
    """The ceiling held 1,024 samples and its epochs were that long: on a larger pack, each of its epochs
    restarted the workers after 16 batches of 64, while the pack's ran on, so with workers the ceiling timed
    their start-up (1M texts: 7,206 samples/s, and the pack '4.84x the ceiling'). It now holds as many
    samples as before, each read as often, in an epoch as long as its source's."""
    result = run_bench(
        pack, workers=0, batch_sizes=BATCH, batches=2, warmup=0, decode="bytes", transform=None, ceiling_samples=8
    )
    facts = next(s for s in result.sources if s["name"] == CEILING)
    assert (facts["samples"], facts["held"]) == (30, 8)
    pairs = [(bytes([i]) * (i + 1), i) for i in range(8)]
    memory = InMemoryDataset(pairs, decode="bytes", length=30)
    assert len(memory) == 30 and [memory[i] for i in range(30)] == [pairs[i % 8] for i in range(30)]
    assert memory[-1] == pairs[29 % 8]
    with pytest.raises(IndexError):
        memory[30]


def test_a_setting_is_timed_at_least_a_second_by_default() -> None:
    """The default budget was 50 batches, whatever they took: 50 batches of 64 small texts are 16 ms, and tune
    recommended 2 workers at 31,854 samples/s over 0 workers that ran at 176,071 in another run. Now
    at least one second, and still at least 50 batches; a budget given is kept as given."""
    memory = InMemoryDataset([(bytes([i % 256]) * 100, i) for i in range(640)], decode="bytes")
    config = LoaderConfig(num_workers=0, batch_size=64)
    timed = measure_loader(memory, config, warmup=0, collate_fn=list_collate)
    assert timed.seconds >= DEFAULT_MIN_SECONDS and timed.batches >= DEFAULT_BATCHES
    assert timed.samples == 64 * timed.batches  # ~1 ms a batch: the second, not the 50 batches, ends it here
    given = measure_loader(memory, config, batches=3, warmup=0, collate_fn=list_collate)
    assert given.batches == 3 and given.seconds < DEFAULT_MIN_SECONDS


@pytest.mark.parametrize("collate", [list, list_collate, None])
def test_samples_are_counted_whatever_the_collate_makes_of_a_batch(collate: Any) -> None:
    """The count guessed a batch's size from its last element: a collate that keeps the batch a list of
    (sample, label) pairs counted 2 samples a batch of 64, and samples/s came out 32x too low."""
    memory = InMemoryDataset([(bytes([i % 256]) * 10, i) for i in range(256)], decode="bytes")
    timed = measure_loader(memory, LoaderConfig(num_workers=0, batch_size=64), batches=3, warmup=0, collate_fn=collate)
    assert timed.samples == 3 * 64


def test_a_folder_names_an_image_it_cannot_decode_and_keeps_its_detected_format(tmp_path: Path) -> None:
    """The folder source raised the decoder's error again with the file's path, and dropped what PIL detected."""
    import io

    from PIL import Image

    from packdata.errors import ImageFormatError

    (tmp_path / "cat").mkdir()
    ppm = io.BytesIO()
    Image.new("RGB", (4, 4)).save(ppm, format="PPM")
    (tmp_path / "cat" / "a.jpg").write_bytes(ppm.getvalue())
    dataset, _ = open_source(tmp_path, decode="pil", transform=None)
    with pytest.raises(ImageFormatError, match=r"cat/a\.jpg: image format PPM is not allowed") as raised:
        dataset[0]
    assert raised.value.detected == "PPM"


def test_the_table_shows_private_memory_as_the_sum_of_the_peaks() -> None:
    """An upper bound, the safe side for a figure that says whether a setting fits: the peak of the total,
    sampled every 0.25 s, understated it (make demo's packs: the main process peaked when no worker was
    alive, so the total never passed the main process's own peak). 300 + 500 MiB shows as 800."""
    from packdata.measure.bench import BenchResult

    mib = 1 << 20
    memory = {
        "main": {"uss_peak": 300 * mib},
        "workers": {"uss_peak": 500 * mib},
        "total": {"uss_peak": 600 * mib, "file_peak": 0},
        "mem_available_min": 8 << 30,
    }
    config = LoaderConfig(num_workers=2, batch_size=4)
    result = ConfigResult("p.lmdb", "lmdb", **asdict(config), samples_per_s=10.0, memory=memory)
    table = BenchResult([result], [], {}, {}).table()
    assert "800.0 MiB" in table and "600.0 MiB" not in table


def _measured(config: LoaderConfig) -> ConfigResult:
    """A setting of p.lmdb measured at 10 samples/s in 1 MiB, for a table built without running a bench."""
    memory = {
        "main": {"uss_peak": 1 << 20},
        "workers": {"uss_peak": 0},
        "total": {"uss_peak": 1 << 20, "file_peak": 0},
        "mem_available_min": 8 << 30,
    }
    return ConfigResult("p.lmdb", "lmdb", **asdict(config), samples_per_s=10.0, memory=memory)


def test_one_run_s_advice_says_repeats_to_python_and_the_flag_to_the_cli(pack: Path) -> None:
    """The table of one run advised 'rerun with --repeat 3', a flag of the CLI, to run_bench's caller, who passes
    repeats=3; bench's CLI, which maps it (repeats is --repeat's keyword), still says --repeat 3."""
    from packdata.measure.bench import BenchResult

    result = _measured(LoaderConfig(num_workers=0, batch_size=BATCH))
    advice = "median of 1 run; spread: (max - min) / median (one run: run again with {} for a noise estimate)"
    assert advice.format("repeats=3") in BenchResult([result], [], {}, {}).table()
    args = ["bench", str(pack), "--workers", "0", "--batch-size", str(BATCH), "--batches", str(BATCHES)]
    said = CliRunner().invoke(cli_main, [*args, "--warmup", "1", "-q"])
    assert said.exit_code == 0, said.output
    assert advice.format("--repeat 3") in said.output, said.output


def test_the_demo_says_the_bench_command_to_repeat_it_not_a_keyword_its_user_cannot_pass(pack: Path) -> None:
    """make demo printed run_bench's 'run again with repeats=3 for a noise estimate': its user passes no keyword
    (nor a flag). It now says 'run the command below' and ends with the packdata bench command line of the
    demo's settings with --repeat 3, which runs as printed (here with --batches 1 and a batch size that the
    small pack fills added)."""
    import importlib.util
    import shlex

    spec = importlib.util.spec_from_file_location("demo", Path(__file__).resolve().parents[1] / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    from packdata.measure.bench import BenchResult

    text = demo.bench_table(BenchResult([_measured(LoaderConfig(2, BATCH))], [], {}, {}), [pack])
    assert "repeats=" not in text and "(one run: for a noise estimate, run the command below)" in text
    *_, said, command = text.splitlines()
    assert said == "For a noise estimate (every setting run 3 times, interleaved), run:"
    words = shlex.split(command)
    assert words[words.index("bench") :] == [
        *("bench", str(pack), "--workers", "2", "--batch-size", "64", "--seconds", "4", "--repeat", "3")
    ]
    quick = ["--batches", "1", "--batch-size", str(BATCH), "-q"]  # the last --batch-size counts: the pack holds 30
    repo = str(Path(__file__).resolve().parents[1])  # the packdata under test, not the one the venv installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([*words, *quick], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "samples/s: median of 3 runs" in done.stdout
    repeated = BenchResult([replace(_measured(LoaderConfig(2, BATCH)), repeats=3)], [], {}, {})
    assert demo.bench_table(repeated, [pack]) == repeated.table()  # no advice, no command


def test_bench_step_ms_reports_the_data_wait_share(pack: Path) -> None:
    """The ceiling's timed loop sleeps the same step as the source's (a ratio over 1.0x is not the step's doing)."""
    result = run_bench(
        pack, workers=0, batch_sizes=BATCH, batches=BATCHES, warmup=1, step_ms=30, decode="bytes", transform=None
    )
    assert sorted(r.source for r in result.results) == sorted([CEILING, str(pack)])
    for r in result.results:
        assert r.step_ms == 30
        assert 0 < r.data_wait_share < 1
        # waiting plus three 30 ms steps is the whole timed wall clock
        assert r.seconds >= BATCHES * 0.030


def test_bench_reduced_decode_and_persistent_workers(pack: Path) -> None:
    result = run_bench(
        pack,
        workers=(2,),
        batch_sizes=(BATCH,),
        batches=BATCHES,
        warmup=1,
        decode="reduced",
        size=32,
        persistent_workers=True,
    )
    _check_consistent(result.to_dict())
    assert result.settings["decode"] == "reduced"
    assert all(r.persistent_workers for r in result.results)
    # what bench reads with decode="reduced": JPEGs DCT-scaled at decode, 64 px tall at full size
    dataset, _ = open_source(pack, decode="reduced", size=32)
    image, _ = dataset[0]
    assert min(image.size) == 32
    full, _ = open_source(pack, decode="pil")[0][0]
    assert min(full.size) == 64


def test_bench_crop_decode_against_the_full_decode_and_crop(pack: Path) -> None:
    result = run_bench(pack, workers=(0,), batch_sizes=(BATCH,), batches=BATCHES, warmup=1, decode="crop", size=32)
    _check_consistent(result.to_dict())
    assert result.settings["decode"] == "crop"
    # the sources decode with DecodeCrop and only flip after it; the ceiling is the work it replaces
    assert "RandomResizedCrop" not in result.settings["transform"]
    ceiling = next(s for s in result.sources if s["name"] == CEILING)
    assert ceiling["decode"] == "pil" and "RandomResizedCrop" in ceiling["transform"]
    assert all(r.vs_ceiling is not None for r in result.for_source(str(pack)))
    assert "what DecodeCrop replaces" in result.table()
    dataset, _ = open_source(pack, decode="crop", transform=None, size=32)
    image, _ = dataset[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8  # DecodeCrop(output="tensor"): no PIL round trip


def test_bench_records_bad_sources_and_settings_without_stopping(pack: Path, tmp_path: Path) -> None:
    result = run_bench([tmp_path / "missing", pack], workers=0, batch_sizes=(BATCH, 64), batches=BATCHES, warmup=1)
    assert any("missing" in w for w in result.warnings)
    by_batch = {(r.source, r.batch_size): r for r in result.results}
    assert by_batch[(str(pack), BATCH)].error is None
    assert "fewer than batch_size=64" in (by_batch[(str(pack), 64)].error or "")


def test_bench_pin_memory_falls_back_without_cuda(pack: Path) -> None:
    result = run_bench(pack, workers=0, batch_sizes=BATCH, pin_memory=True, batches=2, warmup=0)
    for r in result.results:
        assert r.error is None and r.pin_memory
        assert r.pin_memory_effective == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert any("pin_memory" in w for w in result.warnings)


def test_bench_tfrecord_pack(folder: Path, tmp_path: Path) -> None:
    dst = tmp_path / "images-tf"
    packdata.convert(folder, dst, format="tfrecord", progress=False)
    result = run_bench(dst, workers=(0, 2), batch_sizes=BATCH, batches=BATCHES, warmup=1)
    _check_consistent(result.to_dict())
    assert result.sources[0]["from"] == str(dst)


_BURN = """
import sys, time
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def test_cpu_seconds_keep_a_worker_that_has_exited() -> None:
    """A bench's CPU per sample is the difference of two cpu_seconds() readings: a worker that exited between
    them (an epoch's end, workers not persistent) took its CPU time out of the second, and a full-suite run
    reported cpu_ms_per_sample -0.08. A child that burned CPU and then exited still counts, as last seen."""
    sampler = _MemorySampler()
    child = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "burnt\n"
    while_alive = sampler.cpu_seconds()
    child.communicate("")  # its stdin closed: it exits
    assert sampler.cpu_seconds() >= while_alive


def test_bench_cli_writes_json_and_plot(pack: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    args = [
        "bench",
        str(pack),
        "--workers",
        "0",
        "--batch-size",
        str(BATCH),
        "--batches",
        str(BATCHES),
        "--warmup",
        "1",
        "--json",
        str(out),
    ]
    plot = tmp_path / "b.png"
    has_mpl = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        has_mpl = False
    if has_mpl:
        args += ["--plot", str(plot)]
    result = CliRunner().invoke(cli_main, args)
    assert result.exit_code == 0, result.output
    assert "ceiling" in result.output
    _check_consistent(json.loads(out.read_text()))
    if has_mpl:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_cli_refuses_an_output_it_could_not_write_before_measuring(
    pack: Path, tmp_path: Path, option: str
) -> None:
    """The folder of --json or --plot is checked first: it was a traceback after the whole run."""
    (tmp_path / "a-file").write_text("")
    for out in (tmp_path / "no-folder" / "b.png", tmp_path / "a-file" / "b.png"):
        args = ["bench", str(pack), "--workers", "0", "--batch-size", str(BATCH), "--batches", "1", option, str(out)]
        result = CliRunner().invoke(cli_main, args)
        assert result.exit_code == 2, result.output
        assert f"cannot write '{out}': its folder {out.parent} does not exist or is not a folder" in result.output
        assert "ceiling" not in result.output  # nothing was measured
        assert not out.parent.is_dir() or not any(out.parent.iterdir())


@pytest.mark.root
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_cli_refuses_an_output_root_cannot_create_before_measuring(
    pack: Path, tmp_path: Path, tmpfs: Any, option: str
) -> None:
    """Root passes every permission check on a folder, so --json /proc/bench.json (or a file on a read-only
    mount) measured every setting and only then failed to write: now nothing is measured, and an existing
    output file is left as it was."""
    readonly = tmpfs("1m", options="ro")
    kept = tmp_path / "kept.png"
    kept.write_bytes(b"old")
    base = ["bench", str(pack), "--workers", "0", "--batch-size", str(BATCH), "--batches", "1"]
    for out, reason in (("/proc/bench.png", "No such file or directory"), (readonly / "b.png", "Read-only")):
        result = CliRunner().invoke(cli_main, [*base, option, str(out)])
        assert result.exit_code == 2, result.output
        assert f"cannot write '{out}': {reason}" in result.output
        assert "ceiling" not in result.output  # nothing was measured
    if option == "--json":  # a writable one: written at the end, and not created early when a run is refused
        result = CliRunner().invoke(cli_main, [*base, "--workers", "x", option, str(kept)])
        assert result.exit_code == 2 and kept.read_bytes() == b"old"
        fresh = tmp_path / "fresh.json"
        assert CliRunner().invoke(cli_main, [*base, option, str(fresh)]).exit_code == 0
        assert [r["source"] for r in json.loads(fresh.read_text())["results"]] == [CEILING, str(pack)]


def test_bench_sweeping_prefetch_factors_gives_rows_told_apart(pack: Path, tmp_path: Path) -> None:
    """--workers 0,1 --prefetch-factor 2,4 measured 0 workers twice (nothing is prefetched without workers) and
    printed four rows per source in pairs that read the same, 'workers batch samples/s', with different figures:
    no column said which prefetch factor a row had."""
    out = tmp_path / "bench.json"
    args = ["bench", str(pack), "--workers", "0,1", "--prefetch-factor", "2,4", "--batch-size", str(BATCH)]
    result = CliRunner().invoke(cli_main, [*args, "--batches", "1", "--warmup", "0", "-q", "--json", str(out)])
    assert result.exit_code == 0, result.output
    measured = [(r["source"], r["num_workers"], r["prefetch_factor"]) for r in json.loads(out.read_text())["results"]]
    assert measured == [(s, w, f) for s in (CEILING, str(pack)) for w, f in ((0, 2), (1, 2), (1, 4))]
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["source", "workers", "batch", "pf"]
    rows = [line.split()[:4] for line in lines[1:7]]
    assert rows == [
        [s, w, str(BATCH), f] for s in (CEILING, str(pack)) for w, f in (("0", "-"), ("1", "2"), ("1", "4"))
    ]


@pytest.mark.root
@pytest.mark.timeout(120)
def test_bench_available_memory_is_the_containers(folder: Path, cgroup: Any) -> None:
    """'avail min' was the machine's MemAvailable: a bench in a container limited to 1 GiB on a host with tens of
    GiB free said tens of GiB were available. Run in a real memory cgroup of 1 GiB."""
    groups = cgroup(**{"memory.max": str(1 << 30)})

    def join() -> None:  # in the child before it runs: everything it allocates is charged to the cgroup
        for group in groups:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    args = ["bench", str(folder), "--workers", "0,1", "--batch-size", str(BATCH), "--batches", "2", "-q", "--json", "-"]
    done = subprocess.run(
        [sys.executable, "-m", "packdata.cli", *args], capture_output=True, text=True, preexec_fn=join, timeout=110
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)["results"]
    assert results and all(0 < r["memory"]["mem_available_min"] <= 1 << 30 for r in results)


def test_bench_json_names_the_best_setting_the_table_names(pack: Path, folder: Path, tmp_path: Path) -> None:
    """The table ended with 'best: SOURCE with num_workers=N, batch_size=B' but the JSON had no such field: a
    script had to redo the choice (the fastest within the spread, then the fewest workers) and could differ."""
    out = tmp_path / "bench.json"
    args = ["bench", str(pack), str(folder), "--workers", "0,1", "--batch-size", str(BATCH), "--batches", "2", "-q"]
    result = CliRunner().invoke(cli_main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    best = data["results"][data["best"]]
    said = f"best: {best['source']} with --workers {best['num_workers']} --batch-size {best['batch_size']}: "
    assert said in result.stdout and best["source"] != CEILING


def test_bench_cli_says_the_best_setting_as_flags_to_paste_and_the_library_as_keywords(pack: Path) -> None:
    """The CLI's 'best:' line said the library's 'num_workers=2, batch_size=64', which bench's command line does
    not take (--workers, --batch-size): it now says the flags, which a second bench takes as pasted; run_bench's
    table still says the DataLoader's keywords."""
    from packdata.measure.bench import BenchResult

    result = _measured(LoaderConfig(num_workers=2, batch_size=BATCH))
    said = BenchResult([result], [], {}, {}).table().splitlines()[-1]
    assert said == f"best: p.lmdb with num_workers=2, batch_size={BATCH}: 10 samples/s"
    args = ["bench", str(pack), "--workers", "0,1", "--batch-size", f"{BATCH},{2 * BATCH}", "--batches", "1", "-q"]
    first = CliRunner().invoke(cli_main, args)
    assert first.exit_code == 0, first.output
    best = first.stdout.splitlines()[-1]
    pasted = re.fullmatch(rf"best: {re.escape(str(pack))} with (--workers [01] --batch-size [0-9]+): .*", best)
    assert pasted is not None, best
    again = CliRunner().invoke(cli_main, ["bench", str(pack), *pasted.group(1).split(), "--batches", "1", "-q"])
    assert again.exit_code == 0, again.output
    assert again.stdout.splitlines()[-1].startswith(f"best: {pack} with {pasted.group(1)}: ")


def test_the_best_line_names_every_swept_setting_so_a_pasted_one_measures_the_same(pack: Path, tmp_path: Path) -> None:
    """The 'best:' line named only the workers and batch size: with --prefetch-factor 3,4, --pin-memory and
    --persistent-workers a pasted line fell back to prefetch 2, no pinning, no persistent workers. It now names
    each setting swept or set off its default (the library: DataLoader keywords; not those a setting without
    workers ignores), and a second bench given the pasted flags measures exactly the best setting."""
    from packdata.measure.bench import BenchResult

    rows = [_measured(LoaderConfig(2, BATCH, pin, factor, True)) for pin, factor in [(False, 3), (True, 4)]]
    rows[1].samples_per_s = rows[1].samples_per_s_min = 20.0
    said = BenchResult(rows, [], {}, {}).table().splitlines()[-1]
    keywords = f"num_workers=2, batch_size={BATCH}, pin_memory=True, prefetch_factor=4, persistent_workers=True"
    assert said == f"best: p.lmdb with {keywords}: 20 samples/s"
    rows[0].num_workers = 0
    said = BenchResult(rows[:1], [], {}, {}).table().splitlines()[-1]
    assert said == f"best: p.lmdb with num_workers=0, batch_size={BATCH}: 10 samples/s"
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    args = ["--batch-size", str(BATCH), "--prefetch-factor", "3,4", "--pin-memory", "--persistent-workers"]
    ran = CliRunner().invoke(
        cli_main, ["bench", str(pack), "--workers", "1", *args, "--batches", "1", "-q", "--json", str(first)]
    )
    assert ran.exit_code == 0, ran.output
    best = ran.stdout.splitlines()[-1]
    flags = rf"--workers 1 --batch-size {BATCH} --pin-memory --prefetch-factor [34] --persistent-workers"
    pasted = re.fullmatch(rf"best: {re.escape(str(pack))} with ({flags}): .*", best)
    assert pasted is not None, best
    data = json.loads(first.read_text())
    setting = {k: data["results"][data["best"]][k] for k in asdict(LoaderConfig())}
    pasted_args = [*pasted.group(1).split(), "--batches", "1", "-q", "--json", str(again)]
    ran = CliRunner().invoke(cli_main, ["bench", str(pack), *pasted_args])
    assert ran.exit_code == 0, ran.output
    assert json.loads(again.read_text())["settings"]["configs"] == [setting]
    assert ran.stdout.splitlines()[-1].startswith(f"best: {pack} with {pasted.group(1)}: ")


def test_bench_cli_refuses_a_plot_format_matplotlib_does_not_know_before_measuring(pack: Path, tmp_path: Path) -> None:
    """--plot bench.out ran the whole bench, then matplotlib's savefig raised a raw ValueError (a traceback)."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.out"
    args = ["bench", str(pack), "--workers", "0", "--batch-size", str(BATCH), "--batches", "1", "--plot", str(out)]
    result = CliRunner().invoke(cli_main, args)
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: {out}: a plot is written as one of ")
    assert "png" in result.output and "(by its suffix), not out. Name it like bench.png" in result.output
    assert "ceiling" not in result.output and not out.exists()


def test_bench_cli_rejects_bad_lists(pack: Path) -> None:
    result = CliRunner().invoke(cli_main, ["bench", str(pack), "--workers", "two"])
    assert result.exit_code == 2
    assert "comma-separated integers" in result.output


def test_bench_refuses_more_workers_than_the_cpus_run_before_starting_any(pack: Path) -> None:
    """--workers 10000 was taken as it was: bench went on to start 10000 worker processes."""
    cpus = len(os.sched_getaffinity(0))
    most = 8 * cpus
    args = ["bench", str(pack), "--workers", f"0,{most + 1}", "--batch-size", str(BATCH), "--batches", "1"]
    result = CliRunner().invoke(cli_main, args)
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"Error: --workers should be at most {most} (8 per CPU this process may use, {cpus} here), "
        f"but got --workers {most + 1}. Each worker is a process with its own memory: sweep a few per CPU"
    )
    with pytest.raises(ConfigError, match=rf"workers should be at most {most} .*but got workers={most + 1}\."):
        run_bench(pack, workers=most + 1, batch_sizes=BATCH, batches=1, warmup=0)


def test_tune_refuses_more_max_workers_than_the_cpus_run_before_measuring(pack: Path) -> None:
    """--max-workers 10000 was taken as it was: tune went on to try every worker step up to 64."""
    cpus = len(os.sched_getaffinity(0))
    most = 8 * cpus
    result = CliRunner().invoke(cli_main, ["tune", str(pack), "--max-workers", str(most + 1), "--batches", "1", "-q"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"Error: --max-workers should be at most {most} (8 per CPU this process may use, {cpus} here), "
        f"but got --max-workers {most + 1}. Each worker is a process with its own memory: sweep a few per CPU"
    )
    with pytest.raises(ConfigError, match=rf"max_workers should be at most {most} .*but got max_workers={most + 1}\."):
        run_tune(pack, memory_budget=8 << 30, max_workers=most + 1, batches=1, warmup=0)


def test_tune_never_recommends_over_a_tiny_budget(pack: Path) -> None:
    budget = 1 << 20  # one batch of 4 (600 KB at 224 px) fits, 8 and any worker do not
    result = run_tune(pack, memory_budget=budget, batch_sizes=(4, 8), batches=2, warmup=1)
    assert result.recommended.accepted
    assert result.recommended.projected_bytes <= budget
    assert result.recommended.config["num_workers"] == 0 and result.recommended.config["batch_size"] == 4
    for trial in result.trials:
        if trial.accepted:
            assert trial.projected_bytes <= budget
        if trial.projected_bytes > budget:
            assert trial.rejected and not trial.accepted
    assert any(t.config["num_workers"] > 0 and t.rejected for t in result.trials)
    assert "num_workers=0" in result.python()
    json.dumps(result.to_dict())


def test_tune_raises_when_nothing_fits(pack: Path) -> None:
    with pytest.raises(CapacityError, match="no DataLoader setting fits the memory budget of 1000 bytes"):
        run_tune(pack, memory_budget=1000, batch_sizes=(4,), batches=2, warmup=1)


def test_tune_says_why_a_setting_that_fits_could_not_be_measured(pack: Path) -> None:
    """30 samples cannot make a batch of 64: that is the error, not a memory budget the setting fits."""
    with pytest.raises(ConfigError, match="the source holds 30 samples, fewer than batch_size=64"):
        run_tune(pack, memory_budget=8 << 30, max_workers=0, batches=2, warmup=0)
    out = CliRunner().invoke(cli_main, ["tune", str(pack), "--max-workers", "0", "--batches", "2", "-q"])
    assert out.exit_code == 1
    expected = "Error: the source holds 30 samples, fewer than --batch-size 64. Use a smaller --batch-size N\n"
    assert out.output == expected


def test_tune_tries_no_more_workers_than_the_cpus_it_may_use(pack: Path) -> None:
    """Without --max-workers tune climbed to the machine's logical CPUs, whatever its affinity or CPU quota allowed:
    in a container held to a few CPUs of many it measured (and could recommend) settings far past them."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 CPUs to give tune fewer")
    args = ["tune", str(pack), "--batch-size", "4", "--batches", "2", "--memory-budget", "8GiB", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "packdata.cli", *args, "-q"],
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert max(trial["config"]["num_workers"] for trial in json.loads(done.stdout)["trials"]) == 1


def test_tune_measures_workers_and_reports_a_runner_up(pack: Path) -> None:
    result = run_tune(pack, memory_budget=8 << 30, batch_sizes=(4,), max_workers=2, batches=2, warmup=1)
    measured = [t for t in result.trials if t.accepted]
    assert len(measured) >= 2 and result.runner_up is not None
    assert result.runner_up is not result.recommended
    for t in measured:
        if t.config["num_workers"]:
            assert t.per_worker_bytes and t.per_worker_bytes > 0
    data = result.to_dict()
    assert data["recommended"]["kwargs"]["batch_size"] == 4
    if data["recommended"]["kwargs"]["num_workers"]:
        assert data["recommended"]["kwargs"]["worker_init_fn"] == "packdata.worker_init_fn"


def _slow_in_workers(data: bytes) -> bytes:
    """A decode that costs 20 ms in a DataLoader worker and nothing in the main process: what moving
    batches between processes costs samples that take microseconds to decode."""
    if torch.utils.data.get_worker_info() is not None:
        time.sleep(0.02)  # a wait, not CPU: 2 workers overlap it even on a loaded machine
    return data


def test_tune_tries_no_workers_even_after_more_workers_paid(pack: Path) -> None:
    """The climb over num_workers stopped going down once going up paid: from 1 worker, 2 were faster, so
    0 was never tried, and tune recommended 2 workers at 31,854 samples/s for small texts that read at
    176,071 without workers. 0 workers is now always tried, and taken when as fast (within min_gain)."""
    result = run_tune(
        pack, memory_budget=8 << 30, batch_sizes=(8,), max_workers=2, decode=_slow_in_workers, transform=None,
        batches=4, warmup=1,
    )  # fmt: skip
    speeds = {t.config["num_workers"]: t.samples_per_s for t in result.trials if t.step == "num_workers"}
    assert speeds[2] > speeds[1] and speeds[0] > speeds[2], speeds
    assert result.recommended.config["num_workers"] == 0


def test_tune_cli_json(pack: Path) -> None:
    result = CliRunner().invoke(
        cli_main, ["tune", str(pack), "--memory-budget", "1MiB", "--batch-size", "4", "--batches", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["memory_budget"] == 1 << 20
    assert data["recommended"]["projected_bytes"] <= 1 << 20


_SMALL_SHM = """
import sys, torch
from torch.utils.data import DataLoader, Dataset
from packdata.measure.tune import recommend_loader_kwargs

class Images(Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, i):
        return torch.zeros(3, 224, 224, dtype=torch.uint8)

batch = int(sys.argv[1])
kwargs = recommend_loader_kwargs(Images(), batch_size=batch, memory_budget=64 << 30, cores=8)
for i, _ in enumerate(DataLoader(Images(), **kwargs)):
    if i == 30:
        break
print(kwargs["num_workers"])
"""


@pytest.mark.root
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("batch", "workers"), [(8, 2), (64, 0)])
def test_recommended_workers_fit_their_batches_in_dev_shm(batch: int, workers: int) -> None:
    """recommend_loader_kwargs gave 6 workers on 8 cores whatever /dev/shm held: in a container's small /dev/shm
    the workers' batches did not fit, and the DataLoader died ('Caught RuntimeError in DataLoader worker').
    Run in a private mount namespace whose /dev/shm is a real 8 MiB tmpfs; the recommended loader must run."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give a process its own small /dev/shm")
    script = f'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec {sys.executable} -c "$0" {batch}'
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, _SMALL_SHM], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == f"{workers}\n"  # 1.2 MB batches: 2 workers x 2 in flight + 2 held; 9.6 MB: none fits


def test_tune_warns_of_a_budget_over_the_memory_there_is(pack: Path) -> None:
    """--memory-budget 1024TiB was taken silently: tune recommended settings 'within the budget' that the
    machine (or the container's cgroup limit) cannot hold, and the user read them as safe from the OOM killer."""
    args = ["tune", str(pack), "--batch-size", "4", "--batches", "1", "--max-workers", "0", "-q"]
    result = CliRunner().invoke(cli_main, [*args, "--memory-budget", "1024TiB"])
    assert result.exit_code == 0, result.output
    assert re.search(
        r"^warning: memory_budget=1\.0 PiB is more than the [\d.]+ [KMGT]iB this process may still allocate "
        r"\(MemAvailable, or the cgroup limit's headroom\): a setting within it can be OOM-killed$",
        result.stderr,
        re.M,
    ), result.stderr
    fits = CliRunner().invoke(cli_main, [*args, "--memory-budget", "1MiB"])
    assert fits.exit_code == 0 and "warning" not in fits.stderr


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_recommend_loader_kwargs_respects_the_budget(pack: Path) -> None:
    from torch.utils.data import DataLoader

    dataset = packdata.LMDBDataset(pack)
    small = recommend_loader_kwargs(dataset, batch_size=4, memory_budget=1 << 20, cores=8)
    assert small == {"batch_size": 4, "num_workers": 0, "pin_memory": False}
    large = recommend_loader_kwargs(dataset, batch_size=4, memory_budget=64 << 30, cores=8)
    assert large["num_workers"] == 6 and large["persistent_workers"] is True
    assert large["worker_init_fn"] is worker_init_fn
    DataLoader(dataset, **large)  # valid keyword arguments
    capped = recommend_loader_kwargs(dataset, batch_size=16, memory_budget=64 << 30, cores=8)
    assert capped["num_workers"] == 1  # 30 samples make one batch of 16 per epoch
    with pytest.raises(CapacityError, match="exceeds the memory budget"):
        recommend_loader_kwargs(dataset, batch_size=64, memory_budget=1000)
    with pytest.raises(ConfigError, match="batch_size should be at least 1, but got batch_size=0"):
        recommend_loader_kwargs(dataset, batch_size=0)  # a ConfigError, as every other refusal of an option
    config = LoaderConfig(2, 4, False, 3)
    assert project_memory(config, per_worker_bytes=100, sample_bytes=10) == 2 * 100 + 2 * 3 * 4 * 10


def test_bench_cli_says_what_to_do_and_fails_on_a_missing_input(pack: Path, tmp_path: Path) -> None:
    missing = CliRunner().invoke(cli_main, ["bench", str(tmp_path / "nothere")])
    assert missing.exit_code == 1 and "nothere: no such pack or folder" in missing.output
    args = ["bench", str(pack), "--workers", "0", "--batch-size", str(BATCH), "--batches", "2", "--warmup", "0"]
    short = CliRunner().invoke(cli_main, [*args, "--repeat", "2"])
    assert short.exit_code == 0, short.output
    head = short.stdout.splitlines()[0].split()
    assert head[:6] == ["source", "workers", "batch", "samples/s", "spread", "x"]
    assert "cpu" not in head and "wait%" not in head  # wait% means nothing without --step-ms
    assert "median of 2 runs" in short.stdout and "\nbest: " in short.stdout
    assert re.search(r"\s\d+%\s", short.stdout.splitlines()[1])  # the spread of the repeats
    wide = CliRunner().invoke(cli_main, [*args, "--wide", "--step-ms", "1"])
    assert wide.exit_code == 0 and "cpu ms" in wide.stdout.splitlines()[0] and "wait%" in wide.stdout


def test_bench_and_tune_name_a_file_given_as_a_source_once(pack: Path, tmp_path: Path) -> None:
    """It was 'warning: F: F: no such pack or folder', then 'Error: could not measure F: F: no such pack or folder';
    bench now refuses it before measuring the others, as it does a missing source."""
    notes = tmp_path / "notes.txt"
    notes.write_text("x")
    said = f"{notes}: is a regular file, not a pack or a folder. Pass a pack made by `packdata convert` or a folder"
    args = ["bench", str(pack), str(notes), "--workers", "0", "--batch-size", str(BATCH), "--batches", "1", "-q"]
    bench = CliRunner().invoke(cli_main, args)
    assert bench.exit_code == 1
    assert bench.stderr == f"Error: {said}\n"  # no warning saying it first
    assert bench.stdout == ""  # nothing was measured
    tune = CliRunner().invoke(cli_main, ["tune", str(notes)])
    assert tune.exit_code == 1 and tune.output == f"Error: {said}\n"


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_decode_crop_help_says_the_ceiling_is_a_full_decode_whichever_decodes(command: str) -> None:
    """--help said 'else PIL's DCT scaling (bench's ceiling is then PIL's full decode + crop)', as if only without
    TurboJPEG; the ceiling of --decode crop is PIL's full decode + crop with TurboJPEG too (the table says so)."""
    taught = (
        "crop: DecodeCrop, decoding only what the random crop needs: its rows and columns with TurboJPEG 3 (pip "
        "install 'packdata[turbo]'), else PIL's DCT scaling; bench's ceiling for crop is PIL's full decode + crop "
        "(the work DecodeCrop replaces), whichever decodes. [default: pil]"
    )
    assert help_text(command).count(taught) == 1


def test_tune_keeps_the_batch_size_unless_asked_to_search(pack: Path) -> None:
    """tune used to search 32-256 by default and recommend another batch size from noisy 3-batch timings."""
    result = run_tune(pack, memory_budget=8 << 30, batch_sizes=(8,), max_workers=0, batches=2, warmup=0)
    assert {t.config["batch_size"] for t in result.trials} == {8}
    assert "[default: 64]" in CliRunner().invoke(cli_main, ["tune", "--help"]).output
    args = ["tune", str(pack), "--max-workers", "0", "--batches", "2", "--batch-size", "4,8"]
    out = CliRunner().invoke(cli_main, args)
    assert out.exit_code == 0, out.output
    assert "# projected = workers x per-worker private memory" in out.stdout
    # sizes as every command prints them (binary units, one decimal), rates with separators
    assert re.search(
        r"# recommended: [\d,]+ samples/s; .* in this short run \d+\.\d [KMG]iB, projected for training "
        r"\d+\.\d [KMG]iB \(budget \d+\.\d [KMG]iB, ",
        out.stdout,
    ), out.stdout
    tried = CliRunner().invoke(cli_main, [*args, "--json"])
    assert {t["config"]["batch_size"] for t in json.loads(tried.stdout)["trials"]} == {4, 8}


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_quiet_drop_the_progress_lines(pack: Path, command: str) -> None:
    """-q silences the per-setting lines on stderr; the result on stdout stays."""
    args = [command, str(pack), "--batch-size", str(BATCH), "--batches", str(BATCHES)]
    args += ["--workers", "0"] if command == "bench" else ["--max-workers", "0"]
    loud = CliRunner().invoke(cli_main, args)
    quiet = CliRunner().invoke(cli_main, [*args, "-q"])
    assert loud.exit_code == 0 and quiet.exit_code == 0, loud.output + quiet.output
    assert f"{command} " in loud.stderr
    assert f"{command} " not in quiet.stderr
    assert quiet.stdout.strip() and ("samples/s" in quiet.stdout)


class _FailsAt:
    """64 samples; the ones at ``i % 7 == 3`` raise."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        if i % 7 == 3:
            raise ValueError(f"sample {i} is bad")
        return i


def test_workers_of_a_loader_that_raised_are_shut_down_at_once() -> None:
    """Torch's reraise holds the loader's iterator in a reference cycle: its workers lived on until a garbage
    collection, so the next setting's memory samples counted them (and its forks inherited the dead iterator)."""
    import gc

    import psutil

    before = {child.pid for child in psutil.Process().children(recursive=True)}  # the session's own (servers)
    gc.disable()  # what the collector does at random times, the fix must not need
    try:
        with pytest.raises(ValueError, match="is bad"):
            measure_loader(_FailsAt(), LoaderConfig(num_workers=2, batch_size=4), batches=5)  # type: ignore[arg-type]
        assert [c for c in psutil.Process().children(recursive=True) if c.pid not in before] == []
    finally:
        gc.enable()


def test_a_damaged_file_is_named_in_one_line_by_bench_and_tune(tmp_path: Path) -> None:
    """A sample that failed in a worker was reported with the worker's whole traceback (torch puts it in the
    message): many lines in bench's table, an escaped page on tune's Error line; and the folder's file unnamed."""
    root = tmp_path / "damaged" / "class0"
    root.mkdir(parents=True)
    for i in range(8):
        (root / f"{i}.jpg").write_bytes(b"\xff\xd8\xff not a jpeg" if i == 5 else image_bytes(i, (32, 32)))
    result = run_bench(root.parent, workers=1, batch_sizes=8, batches=1, warmup=0)
    (row,) = result.for_source(str(root.parent))
    assert row.error is not None and "\n" not in row.error
    assert row.error.startswith(f"ImageFormatError: {root / '5.jpg'}: not an image")
    assert row.error.endswith("(in DataLoader worker process 0)")
    out = CliRunner().invoke(cli_main, ["tune", str(root.parent), "--batch-size", "8", "--max-workers", "1", "-q"])
    assert out.exit_code == 1
    assert out.output.startswith(f"Error: ImageFormatError: {root / '5.jpg'}: not an image")
    assert out.output.count("\n") == 1 and "Traceback" not in out.output


def test_bench_cli_fails_when_no_setting_of_a_source_could_be_measured(folder: Path) -> None:
    """Every setting failing (30 samples, batch 64) printed a table of errors and exited 0."""
    out = CliRunner().invoke(cli_main, ["bench", str(folder), "--workers", "0", "--batches", "1", "-q"])
    assert out.exit_code == 1
    assert out.output.splitlines()[-1] == (
        f"Error: no setting could be measured: {folder}: ConfigError: the source holds 30 samples, fewer than "
        "--batch-size 64. Use a smaller --batch-size N"
    )
    out = CliRunner().invoke(cli_main, ["bench", str(folder), "--workers", "0", "--batch-size", "4,64", "-q"])
    assert out.exit_code == 0, out.output  # one setting measured: the table is the result


def test_bench_cli_writes_no_plot_when_nothing_was_measured(folder: Path, tmp_path: Path) -> None:
    """Every setting failing (30 samples, batch 64) still wrote an empty plot, said 'plot: FILE', and matplotlib's
    'No artists with labels found' warning leaked to stderr: no file is written now, and the line says why."""
    pytest.importorskip("matplotlib")
    plot = tmp_path / "b.png"
    args = ["bench", str(folder), "--workers", "0", "--batches", "1", "-q", "--plot", str(plot)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = CliRunner().invoke(cli_main, args)
    assert out.exit_code == 1
    assert not plot.exists()
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []  # matplotlib's legend
    assert out.output.splitlines()[-2:] == [
        f"plot: none written to {plot}: no setting was measured",
        f"Error: no setting could be measured: {folder}: ConfigError: the source holds 30 samples, fewer than "
        "--batch-size 64. Use a smaller --batch-size N",
    ]


def test_bench_cli_table_rows_say_a_failed_setting_in_flags(folder: Path) -> None:
    """The rows of a setting that failed said the library's 'fewer than batch_size=64. Use a smaller batch_size=N'
    while the Error line below them said --batch-size: the rows are now said in the same flags."""
    out = CliRunner().invoke(cli_main, ["bench", str(folder), "--workers", "0", "--batches", "1", "-q"])
    assert out.exit_code == 1
    width = len(str(folder))
    error = "error: ConfigError: the source holds 30 samples, fewer than --batch-size 64. Use a smaller --batch-size N"
    lines = out.output.splitlines()
    assert lines[1:3] == [f"{'ceiling':<{width}}       0    64  {error}", f"{folder}       0    64  {error}"]
    assert "batch_size" not in out.output


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_multiprocessing_helpers_are_not_counted_as_workers(context: str) -> None:
    """With spawn and forkserver, the resource tracker and the fork server (Python children of the main
    process) were counted and sampled as DataLoader workers, by bench's memory figures and the monitor."""
    from torch.utils.data import DataLoader

    from packdata.watch.probe import SystemProbe

    data = InMemoryDataset([(b"x" * 100, 0)] * 16, decode="bytes")
    result = measure_loader(
        data, LoaderConfig(num_workers=1, batch_size=4), batches=2, warmup=0, collate_fn=list_collate,
        multiprocessing_context=context,
    )  # fmt: skip
    assert result.memory["processes_peak"] == 2  # the main process and its worker
    loader = DataLoader(data, batch_size=4, num_workers=1, collate_fn=list_collate, multiprocessing_context=context)
    iterator = iter(loader)
    next(iterator)
    assert len(SystemProbe(gpus=False, packs=False).sample().workers) == 1
    del iterator


class _CrashesInWorkers:
    """A transform whose worker process dies (as one the OOM killer took); fine in the main process."""

    def __call__(self, image: Any) -> torch.Tensor:
        if torch.utils.data.get_worker_info() is not None:
            os._exit(3)
        return torch.zeros(3, 8, 8, dtype=torch.uint8)


def _fails(image: Any) -> torch.Tensor:
    raise RuntimeError("the transform failed")


def test_tune_rejects_a_setting_whose_workers_crash_and_goes_on(pack: Path) -> None:
    """A worker that died raised torch's RuntimeError out of tune (a traceback from the CLI), where bench
    records it for that setting."""
    result = run_tune(
        pack, transform=_CrashesInWorkers(), batch_sizes=(4,), max_workers=1, batches=2, warmup=0, memory_budget=8 << 30
    )
    assert result.recommended.config["num_workers"] == 0
    (crashed,) = [t for t in result.trials if t.config["num_workers"] == 1]
    assert crashed.rejected is not None and "exited unexpectedly" in crashed.rejected
    with pytest.raises(packdata.PackdataError, match="RuntimeError: the transform failed"):
        run_tune(pack, transform=_fails, batch_sizes=(4,), max_workers=0, batches=2, warmup=0, memory_budget=8 << 30)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_budget_or_period_that_never_ends_is_refused(pack: Path, value: str) -> None:
    """click's FloatRange takes 'nan' and 'inf': bench --seconds nan or inf timed forever (a hang), --step-ms
    inf and monitor --interval nan or inf ended in a traceback from time.sleep; run_bench took them too."""
    for args in (["bench", str(pack), "--seconds", value], ["bench", str(pack), "--step-ms", value]):
        out = CliRunner().invoke(cli_main, [*args, "--workers", "0", "--batch-size", "4", "-q"])
        assert out.exit_code == 2 and f"{value!r} is not a finite number" in out.output, out.output
    out = CliRunner().invoke(cli_main, ["monitor", str(os.getpid()), "--interval", value, "--count", "1"])
    assert out.exit_code == 2 and f"{value!r} is not a finite number" in out.output, out.output
    with pytest.raises(ConfigError, match="seconds should be a positive finite number"):
        run_bench(pack, workers=0, batch_sizes=4, seconds=float(value))
    with pytest.raises(ConfigError, match="step_ms should be a finite number"):
        measure_loader(InMemoryDataset([(b"x", 0)] * 8, decode="bytes"), LoaderConfig(0, 4), step_ms=float(value))


def test_bench_refuses_a_step_no_sleep_takes(pack: Path) -> None:
    """--step-ms 1e300 passed the finiteness check, and the first simulated step raised OverflowError ('timestamp
    out of range for platform time_t') out of the measurement: a traceback. A step is now at most an hour."""
    args = ["bench", str(pack), "--workers", "0", "--batch-size", "4", "--batches", "1", "-q", "--step-ms", "1e300"]
    out = CliRunner().invoke(cli_main, args)
    assert out.exit_code == 1, out.output
    assert out.output == "Error: --step-ms should be at most 3600000 (an hour), but got --step-ms 1e+300\n"


def test_tune_refuses_a_device_torch_does_not_know(pack: Path) -> None:
    """torch.device('foo') raised its RuntimeError out of run_tune and recommend_loader_kwargs: a traceback from
    packdata tune --device foo."""
    out = CliRunner().invoke(cli_main, ["tune", str(pack), "--device", "foo", "--batch-size", "4", "-q"])
    assert out.exit_code == 1
    assert out.output == "Error: --device should be a torch device such as 'cuda' or 'cpu', but got --device foo\n"
    with pytest.raises(ConfigError, match="but got device='gpu0'"):
        recommend_loader_kwargs(device="gpu0")


def test_a_budget_shorter_than_one_batch_still_times_one() -> None:
    """seconds=1e-6 ended the timed loop before any batch: 0 samples/s was reported as a measured rate."""
    data = InMemoryDataset([(b"x", 0)] * 8, decode="bytes")
    result = measure_loader(data, LoaderConfig(0, 4), seconds=1e-9, warmup=0, collate_fn=list_collate)
    assert result.batches == 1 and result.samples == 4 and result.samples_per_s > 0
