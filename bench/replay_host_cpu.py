"""``runner.replay()`` on a CPU against populate alone.

The goal of the lean replay path: with a trivial forward, the eager
mechanism and the decode buffers, 7 live rows padded to 8, a whole
``replay()`` costs at most 0.5x populate alone as it was before the lean
path (per-field input checks, then the grouped torch writer), measured in the
same run; one copy and one fill per field
(:func:`bench.bench_replay_host.per_field_populate`) and today's
``populate()`` are shown beside it. Every variant is first checked to leave
the buffers byte-identical (tails poisoned before each).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_replay_host --cpu``
(writes ``bench/results/replay-host-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from bench.bench_replay_host import per_field_populate
from bench.conftest import RESULTS_DIR, machine
from bench.host_timing import HostTimes, summarize, time_idle
from graphrunner import GraphRunner, create_runner, decode_buffer_specs
from graphrunner.testing import ToyWorld, torch_threads
from graphrunner.writers import populate
from graphrunner.writers.base import check_sources

CPU_CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_replay_host --cpu"
#: The issue's baseline: populate() as it was before the lean path (checked, grouped).
MAIN_POPULATE = "checked grouped populate (populate() before the lean path)"
GOAL = 0.5
POISON = -7


def grouped_populate(runner: GraphRunner, batch: Any, bs: int) -> Callable[[], None]:
    """The grouped torch writer before the staged write (for comparison):
    one ``_foreach_copy_`` of the live rows, one ``_foreach_zero_`` of the
    zero tails, one ``fill_`` per filled tail (all decode fields are int64)."""
    raw_bs, specs, tensors = batch.batch_size, runner.buffers.specs, runner.buffers.tensors
    live = [tensors[s.name][:raw_bs] for s in specs]
    zeros = [tensors[s.name][raw_bs:bs] for s in specs if s.pad_value() == 0]
    fills = [(tensors[s.name][raw_bs:bs], s.pad_value()) for s in specs if s.pad_value()]

    def populate() -> None:
        torch._foreach_copy_(live, [getattr(batch, s.name) for s in specs], non_blocking=True)
        torch._foreach_zero_(zeros)
        for tail, value in fills:
            tail.fill_(value)

    return populate


def _check_same_bytes(runner: GraphRunner, variants: dict[str, Callable[[], Any]]) -> None:
    """Every variant writes the same bytes into poisoned buffers (the oracle)."""
    written = []
    for fn in variants.values():
        for t in runner.buffers.tensors.values():
            t.fill_(POISON)
        fn()
        written.append({k: t.clone() for k, t in runner.buffers.tensors.items()})
    for name, t in written[0].items():
        for other in written[1:]:
            assert torch.equal(t, other[name]), f"{name}: the variants wrote different values"


def _no_sync() -> None:
    """Nothing to drain: a CPU step is done when its call returns."""


def measure_cpu(rounds: int = 40, calls: int = 500) -> dict[str, Any]:
    """On the CPU: ``runner.replay()`` (eager mechanism, decode buffers, a
    trivial forward) against the per-field populate alone, 7 live rows padded
    to 8, one thread, under ``no_grad``; the variants interleaved in
    ``rounds`` blocks of ``calls`` individually timed calls
    (:func:`bench.host_timing.time_idle`, nothing to drain on the CPU);
    medians and p10-p90 over all blocks."""
    world = ToyWorld()
    batch = world.make_batch(7, seed=0)
    runner = create_runner(
        lambda b: b.input_ids,
        decode_buffer_specs(),
        kind="eager",
        device="cpu",
        capture_sizes=[8],
        show_progress=False,
    )
    runner.capture()
    grouped = grouped_populate(runner, batch, 8)
    variants = {
        "per-field populate": per_field_populate(runner, batch, 8),
        "grouped populate (copy, zero, fills)": grouped,
        MAIN_POPULATE: lambda: (
            check_sources(runner.buffers, batch, 7),
            grouped(),
        ),
        "populate() now (checked, packed fields staged)": lambda: populate(
            runner.buffers, batch, 7, 8
        ),
        "replay": lambda: runner.replay(batch),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch_threads(1), torch.no_grad():
        _check_same_bytes(runner, variants)
        for _ in range(rounds):
            for name, fn in variants.items():
                block = time_idle(fn, sync=_no_sync, blocks=1, calls_per_block=calls, warmup=0)
                samples[name].extend(block.samples_us)
    times: dict[str, HostTimes] = {name: summarize(t, "idle") for name, t in samples.items()}
    medians = {name: t.median_us for name, t in times.items()}
    return {
        "medians_us": {k: round(v, 2) for k, v in medians.items()},
        "spreads_us": {k: t.spread() for k, t in times.items()},
        "ratio": round(medians["replay"] / medians["per-field populate"], 3),
        "ratios": {k: round(medians["replay"] / v, 3) for k, v in medians.items()},
        "calls": rounds * calls,
        "threads": 1,
    }


def write_cpu(result: dict[str, Any]) -> str:
    info = machine()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "")
    info = {**info, "lscpu_model": model, "threads": str(result["threads"]), "command": CPU_CMD}
    m = result["medians_us"]
    against = result["ratios"][MAIN_POPULATE]
    text = (
        "\n".join(
            [
                "# Replay host time: CPU",
                "",
                *(f"- {k}: {v}" for k, v in info.items()),
                "",
                "7 live rows padded to 8, eager mechanism, decode buffers, trivial forward, "
                f"under no_grad; each call timed on its own (bench/host_timing.py), medians and "
                f"p10-p90 of {result['calls']} calls each, interleaved.",
                "",
                "| variant | median µs | p10-p90 µs | replay / this |",
                "|---|---|---|---|",
                *(
                    f"| {k} | {v:.2f} | {result['spreads_us'][k]} | {result['ratios'][k]:.2f} |"
                    for k, v in m.items()
                ),
                "",
                f"replay / {MAIN_POPULATE}: **{against:.2f}x** (goal at most {GOAL}x: "
                f"{'met' if against <= GOAL else 'NOT met'}); replay / per-field populate: "
                f"**{result['ratio']:.2f}x**.",
                "",
                "per-field populate: one copy and one fill per field. grouped populate: the "
                "torch writer before the lean path (one foreach copy, one foreach zero, "
                "one fill). checked: with its per-field input checks (check_sources) "
                "before it, as populate() did. populate() now: the same checks, then the "
                "decode fields (one allocation) written by one cat of live rows and tails.",
            ]
        )
        + "\n"
    )
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "replay-host-cpu.md").write_text(text)
    payload = {"machine": info, **result}
    (RESULTS_DIR / "replay-host-cpu.json").write_text(json.dumps(payload, indent=1) + "\n")
    return text
