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

Host time: the GPU is idle before each call (synchronized, not timed), the
call alone is timed; median and p90 of ``ROUNDS`` calls. NVTX is on, no
profiler attached. Launches per step come from a torch profiler trace of
``TRACED`` steps (CUDA runtime and driver launch, copy and set calls).

Run on a GPU: ``.venv/bin/python -m bench.bench_replay_host`` (prints the
table, writes ``bench/results/replay-host-<device>.md`` and ``.json``).
Without a GPU it says so and exits; as a pytest item it is skipped.

On a CPU, ``--cpu``: ``runner.replay()`` with a trivial forward (eager
mechanism, the decode buffers, 7 live rows padded to 8) against the
per-field populate alone (one copy and one fill per field), in the same run,
checked to write the same bytes (:mod:`bench.replay_host_cpu`); writes
``bench/results/replay-host-cpu.*``.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from bench.conftest import RESULTS_DIR, machine
from graphrunner import GraphRunner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.declare.decode import DECODE_FIELD_NAMES
from graphrunner.engine.loop import create_model_runner
from graphrunner.model import ModelBundle, default_model
from graphrunner.phases.base import SpecBatch
from graphrunner.writers.base import check_sources, write_sources
from graphrunner.writers.fused import FusedPopulate

SIZES = [1, 8, 64, 256]
RAW = {1: 1, 8: 7, 64: 63, 256: 255}  # all but the smallest replay padded
MODES = ["torch", "fused", "graph"]
ROUNDS = 200
WARMUP = 30
TRACED = 20
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


def _host_us(fn: Callable[[], Any]) -> tuple[float, float]:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e3)
    torch.cuda.synchronize()
    times.sort()
    return statistics.median(times), times[int(0.9 * len(times))]


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
        runners[mode] = create_model_runner(bundle, "cuda", capture_sizes=SIZES, populate=mode)
        runners[mode].capture()
    rows = []
    for bs in SIZES:
        raw_bs = RAW[bs]
        batch = _batch(bundle, raw_bs)
        variants = _variants(runners, batch, bs)
        for name, fn in variants.items():
            median, p90 = _host_us(fn)
            launches, graphs = _launches(fn)
            rows.append(
                {
                    "raw_bs": raw_bs,
                    "bs": bs,
                    "variant": name,
                    "host_us_median": round(median, 2),
                    "host_us_p90": round(p90, 2),
                    "device_calls_per_step": launches,
                    "besides_graph": launches - graphs,
                }
            )
            print(rows[-1], flush=True)  # progress, should the run be cut short
    return rows


def write(rows: list[dict[str, Any]]) -> str:
    info = machine()
    bare = {r["bs"]: r["host_us_median"] for r in rows if r["variant"] == "bare"}
    medians = {(r["bs"], r["variant"]): r["host_us_median"] for r in rows}
    lines = [
        f"# Replay host time: {info['device']}",
        "",
        f"torch {info['torch']}, python {info['python']}, {info['date']}. Host µs per call "
        f"(GPU idle before each, {ROUNDS} calls), device calls per step from a profiler "
        f"trace ({TRACED} steps). Per-field / this: against per-field with the same "
        f"inputs (device fields, or host fields for the rows marked so).",
        "",
        "| raw -> graph | variant | median µs | p90 µs | x bare | per-field / this "
        "| device calls | besides graph |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bs = r["bs"]
        host = r["variant"].endswith("(host fields)")
        per_field = medians[(bs, "per-field (host fields)" if host else "per-field")]
        lines.append(
            f"| {r['raw_bs']} -> {bs} | {r['variant']} | {r['host_us_median']:.1f} | "
            f"{r['host_us_p90']:.1f} | {r['host_us_median'] / bare[bs]:.1f} | "
            f"{per_field / r['host_us_median']:.2f} | {r['device_calls_per_step']:g} | "
            f"{r['besides_graph']:g} |"
        )
    text = "\n".join(lines) + "\n"
    slug = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"replay-host-{slug}.md").write_text(text)
    payload = {"machine": info, "rows": rows}
    (RESULTS_DIR / f"replay-host-{slug}.json").write_text(json.dumps(payload, indent=1) + "\n")
    return text


def bench_replay_host() -> None:
    """The whole table (collected by ``make bench``); skipped without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("replay host time is measured on a CUDA device")
    print(write(measure()))


def main() -> int:
    if "--cpu" in sys.argv[1:]:
        from bench.replay_host_cpu import measure_cpu, write_cpu

        print(write_cpu(measure_cpu()))
        return 0
    if not torch.cuda.is_available():
        print("bench_replay_host: no CUDA device; nothing measured (run it on a GPU, or --cpu)")
        return 0
    print(write(measure()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
