"""Host time of one replay, and device launches per step, on a GPU.

For live batches of 1, 7, 63 and 255 rows (graphs of 1, 8, 64, 256) of the
reference model, in one run:

* ``bare``: ``graph.replay()`` alone (the floor every variant is compared with);
* ``per-field``: one copy and one fill per field, then ``graph.replay()``
  (how engines without a declared populate do it);
* ``torch``: ``runner.replay()`` with the grouped torch populate;
* ``fused``: ``runner.replay()`` with the fused Triton populate (one launch);
* ``graph``: ``runner.replay()`` with the populate captured inside the graph;
* ``... (host fields)``: the same with every integer field a pinned CPU
  tensor, as a scheduler that builds its batch on the host hands it over:
  per-field (one host-to-device copy per field) against the fused and
  in-graph writers (the fields' bytes ride in the table's one copy);
* the parts, no graph launched: the torch populate alone, the fused populate
  alone (table staging, copy, launch), the Triton launch alone.

Host time (:mod:`bench.host_timing`): every call timed on its own, after a
warm-up, in two modes: **idle** (the GPU drained before each call, untimed)
and **busy** (calls back to back queued behind a ``torch.cuda._sleep``, the
host running ahead, checked to still be busy after the last call); median
and p10-p90 of each, each variant against the bare launch of the same mode
and size measured in the same run. NVTX is on, no profiler attached while
timing. Launches per step come from a torch profiler trace of ``TRACED``
steps (CUDA runtime and driver launch, copy and set calls).

Run on a GPU: ``.venv/bin/python -m bench.bench_replay_host`` or
``bash bench/gpu_steps.sh replay`` (prints the table, writes
``bench/results/replay-host-<device>.md`` and ``.json``, naming the command,
device, driver, CUDA and torch versions, the method and the 15 µs goal:
:mod:`bench.replay_host_report`).
Without a GPU it says so and exits; as a pytest item it is skipped.

On a CPU, ``--cpu``: ``runner.replay()`` with a trivial forward (eager
mechanism, the decode buffers, 7 live rows padded to 8) against the
per-field populate alone (one copy and one fill per field), in the same run,
checked to write the same bytes (:mod:`bench.replay_host_cpu`); writes
``bench/results/replay-host-cpu.*``. Then the token batch
(:func:`measure_token_cpu`): ``runner.replay()`` of a
:class:`~graphrunner.phases.SpecBatch` as ``token_batch_inputs`` builds it,
and of the same tensors in a plain ``SpecBatch`` (never sealed), against the
checked ``populate()``; writes ``bench/results/replay-host-cpu-token-batch.*``.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.conftest import RESULTS_DIR, machine
from bench.cuda_host_timing import cuda_host_times, sleep_cycles_per_us
from bench.host_timing import HostTimes, summarize, time_idle
from bench.replay_host_report import gpu_info, write_results
from graphrunner import GraphRunner, create_runner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.declare.buffers import StepSize
from graphrunner.declare.decode import DECODE_FIELD_NAMES
from graphrunner.phases import token_batch_phase
from graphrunner.phases.base import SpecBatch
from graphrunner.testing import ToyWorld, torch_threads
from graphrunner.writers.base import check_sources, populate, write_sources
from graphrunner.writers.fused import FusedPopulate
from graphrunner.writers.staging import DEPTH
from graphrunner_ref.engine.loop import create_decode_runner
from graphrunner_ref.model import ModelBundle, default_model

SIZES = [1, 8, 64, 256]
RAW = {1: 1, 8: 7, 64: 63, 256: 255}  # all but the smallest replay padded
MODES = ["torch", "fused", "graph"]
WARMUP = 30
IDLE_BLOCKS, IDLE_CALLS = 10, 40
#: Busy blocks of DEPTH calls: a fused or in-graph populate further ahead than
#: its staging ring would wait for the GPU (the busy check would refuse it).
BUSY_BLOCKS, BUSY_CALLS = 50, DEPTH
OCCUPY_MIN_US = 2000.0  # the busy mode's sleep per block, at least
OCCUPY_TRIES = 4  # doubling the sleep each time the GPU went idle under the calls
TRACED = 20
PARAMS = {
    "warmup": WARMUP,
    "idle_blocks": IDLE_BLOCKS,
    "idle_calls_per_block": IDLE_CALLS,
    "busy_blocks": BUSY_BLOCKS,
    "busy_calls": BUSY_CALLS,
    "traced": TRACED,
}
#: Profiler event names that put work on the device (per step, besides nothing else).
_LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaMemcpy|cudaMemset|cudaGraphLaunch)")


def _batch(bundle: ModelBundle, raw_bs: int) -> DecodeBatch:
    bundle.req_pool.clear()
    bundle.kv_alloc.clear()
    reqs = bundle.req_pool.alloc(raw_bs)
    ids = torch.randint(256, (raw_bs,), generator=torch.Generator().manual_seed(raw_bs))
    batch = DecodeBatch.from_requests(
        reqs,
        [8] * raw_bs,
        ids.to(bundle.device),
        device=bundle.device,
        max_context_len=bundle.max_context_len,
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return batch


def _host_fields(batch: DecodeBatch) -> SpecBatch:
    """``batch`` with every device field a pinned CPU tensor (host-produced)."""
    return SpecBatch(
        req_pool_indices_cpu=batch.req_pool_indices_cpu,
        seq_lens_cpu=batch.seq_lens_cpu,
        **{name: getattr(batch, name).cpu().pin_memory() for name in DECODE_FIELD_NAMES},
    )


def per_field_populate(runner: GraphRunner, batch: Any, bs: int) -> Callable[[], None]:
    """The reference populate: one copy and one fill per field (how engines
    without a declared populate write their buffers)."""
    raw_bs = batch.batch_size
    fields = [(runner.buffers.tensors[s.name], s.name, s.pad_value()) for s in runner.buffers.specs]

    def populate() -> None:
        for buf, name, pad in fields:
            buf[:raw_bs].copy_(getattr(batch, name), non_blocking=True)
            if pad is not None and bs > raw_bs:
                buf[raw_bs:bs].fill_(pad)

    return populate


def _per_field(runner: GraphRunner, batch: Any, bs: int) -> Callable[[], None]:
    """One copy and one fill per field, then the graph (no declared populate)."""
    graph = runner.graphs[bs]  # type: ignore[attr-defined]
    populate = per_field_populate(runner, batch, bs)

    def step() -> None:
        populate()
        graph.replay()

    return step


def _variants(
    runners: dict[str, GraphRunner], batch: DecodeBatch, bs: int
) -> dict[str, Callable[[], Any]]:
    raw_bs = batch.batch_size
    reference = runners["torch"]
    sources = check_sources(reference.buffers, batch, raw_bs)
    fused = runners["fused"].mechanism.populate_writer
    assert isinstance(fused, FusedPopulate)
    grid = fused.grid(raw_bs, bs)

    host = _host_fields(batch)

    def replay(runner: GraphRunner, inputs: Any = batch) -> Callable[[], Any]:
        return lambda: runner.replay(inputs)

    return {
        "bare": reference.graphs[bs].replay,  # type: ignore[attr-defined]
        "per-field": _per_field(reference, batch, bs),
        **{mode: replay(runners[mode]) for mode in MODES},
        "per-field (host fields)": _per_field(reference, host, bs),
        **{f"{mode} (host fields)": replay(runners[mode], host) for mode in MODES[1:]},
        # The parts, for where the time goes (no graph launched):
        "populate alone: torch": lambda: write_sources(reference.buffers, sources, raw_bs, bs),
        "populate alone: fused": lambda: fused.write(sources, raw_bs, bs),
        "kernel launch alone": lambda: fused.launch(grid),
    }


def host_times(fn: Callable[[], Any], cycles_per_us: float) -> tuple[HostTimes, HostTimes, float]:
    """(idle, busy, the busy mode's sleep per block in µs) with this bench's counts."""
    return cuda_host_times(
        fn,
        cycles_per_us,
        warmup=WARMUP,
        idle_blocks=IDLE_BLOCKS,
        idle_calls=IDLE_CALLS,
        busy_blocks=BUSY_BLOCKS,
        busy_calls=BUSY_CALLS,
        occupy_min_us=OCCUPY_MIN_US,
        tries=OCCUPY_TRIES,
    )


def _launches(fn: Callable[[], Any]) -> tuple[float, float]:
    """(device work calls per step, graph launches per step) from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(TRACED):
            fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if _LAUNCH.match(e.name)]
    graphs = sum(n.startswith("cudaGraphLaunch") for n in names)
    return len(names) / TRACED, graphs / TRACED


def measure() -> list[dict[str, Any]]:
    bundle = default_model(max_requests=max(SIZES) + 1, max_context_len=64, device="cuda")
    runners: dict[str, GraphRunner] = {}
    for mode in MODES:
        runners[mode] = create_decode_runner(bundle, "cuda", capture_sizes=SIZES, populate=mode)
        runners[mode].capture()
    cycles_per_us = sleep_cycles_per_us()
    rows = []
    for bs in SIZES:
        raw_bs = RAW[bs]
        batch = _batch(bundle, raw_bs)
        variants = _variants(runners, batch, bs)
        for name, fn in variants.items():
            idle, busy, occupy_us = host_times(fn, cycles_per_us)
            launches, graphs = _launches(fn)
            rows.append(
                {
                    "raw_bs": raw_bs,
                    "bs": bs,
                    "variant": name,
                    "idle": idle.summary(),
                    "busy": busy.summary(),
                    "occupy_us": round(occupy_us),
                    "device_calls_per_step": launches,
                    "besides_graph": launches - graphs,
                }
            )
            print(rows[-1], flush=True)  # progress, should the run be cut short
    return rows


def write(
    rows: list[dict[str, Any]],
    info: dict[str, str] | None = None,
    results_dir: Path = RESULTS_DIR,
) -> str:
    """Write the table (:mod:`bench.replay_host_report`) and return its text."""
    path = write_results(rows, gpu_info() if info is None else info, PARAMS, results_dir)
    return path.read_text()


def bench_replay_host() -> None:
    """The whole table (collected by ``make bench``); skipped without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("replay host time is measured on a CUDA device")
    print(write(measure()))


#: The token batch's step: 7 tokens of 3 requests (a chunk, two decode rows),
#: padded to the 8-token graph (4 requests), with a trivial forward.
TOKEN_CHUNKS = [(0, 5), (9, 1), (4, 1)]
TOKEN_CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_replay_host --cpu"


def _plain(batch: SpecBatch) -> SpecBatch:
    """The same tensors in a new :class:`SpecBatch` that nobody sealed (a
    hand-built step, as engines build one)."""
    tensors = batch.tensors()
    mirrors = {n: tensors.pop(n) for n in ("req_pool_indices_cpu", "seq_lens_cpu")}
    return SpecBatch(**mirrors, **tensors)


def _alternating(runner: GraphRunner, batches: list[SpecBatch]) -> Callable[[], Any]:
    """Replays of two batches in turn: each replay sees other tensors than the
    last, so no check is skipped by identity (a new step every time)."""
    state = [0]

    def step() -> Any:
        state[0] ^= 1
        return runner.replay(batches[state[0]])

    return step


def measure_token_cpu(rounds: int = 40, calls: int = 500) -> dict[str, Any]:
    """On the CPU, one thread, under ``no_grad``: a token batch's replay
    (eager mechanism, the token-batch buffers, a trivial forward) of
    :data:`TOKEN_CHUNKS`, two steps alternating, as ``token_batch_inputs``
    builds them and as plain ``SpecBatch`` copies, against the checked
    ``populate()`` of one step; interleaved blocks of ``calls`` timed calls."""
    world = ToyWorld()
    phase = token_batch_phase(lambda b: b.seq_lens, max_requests=4)
    runner = create_runner(phase, kind="eager", capture_sizes=[8], show_progress=False)
    runner.capture()
    built = [world.make_token_batch(TOKEN_CHUNKS, seed=s) for s in (0, 1)]
    raw, bs = StepSize(7, 3), runner.buffers.size_of(8)
    variants = {
        "token batch: populate() (checked)": lambda: populate(runner.buffers, built[0], raw, bs),
        "token batch: replay, token_batch_inputs' SpecBatch": _alternating(runner, built),
        "token batch: replay, plain SpecBatch": _alternating(runner, [_plain(b) for b in built]),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch_threads(1), torch.no_grad():
        for _ in range(rounds):
            for name, fn in variants.items():
                block = time_idle(fn, sync=lambda: None, blocks=1, calls_per_block=calls, warmup=0)
                samples[name].extend(block.samples_us)
    times: dict[str, HostTimes] = {name: summarize(t, "idle") for name, t in samples.items()}
    base = times["token batch: populate() (checked)"].median_us
    return {
        "medians_us": {k: round(t.median_us, 2) for k, t in times.items()},
        "spreads_us": {k: t.spread() for k, t in times.items()},
        "per_checked_populate": {k: round(t.median_us / base, 3) for k, t in times.items()},
        "full_checks": runner.input_gate.full_checks,
        "calls": rounds * calls,
        "threads": 1,
    }


def write_token_cpu(result: dict[str, Any], results_dir: Path = RESULTS_DIR) -> str:
    """Write ``replay-host-cpu-token-batch.md`` and ``.json``; return the text."""
    info = {**machine(), "command": TOKEN_CMD}
    rows = [
        f"| {k} | {v:.2f} | {result['spreads_us'][k]} | {result['per_checked_populate'][k]:.2f} |"
        for k, v in result["medians_us"].items()
    ]
    text = "\n".join(
        [
            "# Replay host time, token batch: CPU",
            "",
            *(f"- {k}: {v}" for k, v in info.items()),
            "",
            f"{TOKEN_CHUNKS} (7 tokens, 3 requests) padded to 8 tokens x 4 requests, eager "
            f"mechanism, trivial forward, one thread, no_grad; two steps replayed in turn; "
            f"medians and p10-p90 of {result['calls']} calls each, interleaved. Full input "
            f"checks run by the runner in all: {result['full_checks']}.",
            "",
            "| variant | median µs | p10-p90 µs | / checked populate |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    results_dir.mkdir(exist_ok=True)
    (results_dir / "replay-host-cpu-token-batch.md").write_text(text + "\n")
    payload = json.dumps({"machine": info, **result}, indent=1)
    (results_dir / "replay-host-cpu-token-batch.json").write_text(payload + "\n")
    return text + "\n"


def main() -> int:
    if "--cpu" in sys.argv[1:]:
        from bench.replay_host_cpu import measure_cpu, write_cpu

        print(write_cpu(measure_cpu()))
        print(write_token_cpu(measure_token_cpu()))
        return 0
    if not torch.cuda.is_available():
        print("bench_replay_host: no CUDA device; nothing measured (run it on a GPU, or --cpu)")
        return 0
    print(write(measure()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
