"""The CPU runner's cold capture at N decode steps per launch: the model's
step compiled once and called N times (``multistep_forward(...,
compile_step_once=True)``) against N inlined copies compiled as one program
(what ``create_decode_runner(kind="cpu", steps_per_launch=N)`` builds), in
the same run.

A throwaway capture first (inductor's one-time start-up out of the first
figure), then for each N: one capture size (``--size``), inductor's caches
off so every capture compiles from scratch, then a greedy trace served at N
(tokens checked equal between the two programs) and the median time per
launch over ``--rounds`` runs, the two programs alternating run by run. The
embedded default model, one torch thread.
Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_multistep_capture``
(writes ``bench/results/multistep-capture-cpu.md`` and ``.json``). Not
collected as a test or a pytest benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch._inductor.config as inductor_config

import graphrunner.phases.multistep as multistep_module
from bench.conftest import RESULTS_DIR, machine
from graphrunner.testing import torch_threads
from graphrunner_ref import Engine, Request, create_decode_runner, default_model

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_multistep_capture"


@contextlib.contextmanager
def step_once() -> Iterator[None]:
    """Runners built inside compile the step once (a nested compile region)."""
    real = multistep_module.multistep_forward

    def once(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "compile_step_once": True})

    multistep_module.multistep_forward = once
    try:
        yield
    finally:
        multistep_module.multistep_forward = real


def capture(n: int, size: int) -> dict[str, Any]:
    """A cold capture's seconds, its engine and trace, and the trace's tokens."""
    bundle = default_model(max_requests=size, max_context_len=96)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[size], steps_per_launch=n)
    start = time.perf_counter()
    runner.capture()
    seconds = time.perf_counter() - start
    trace = [Request(i, (3 + i, 5 + i, 7 + i), 48) for i in range(size)]
    engine = Engine(bundle, runner, steps_per_launch=n)
    return {
        "capture_s": seconds,
        "engine": engine,
        "trace": trace,
        "out": engine.run(trace).outputs,
    }


def time_launches(runs: list[dict[str, Any]], rounds: int) -> None:
    """Each run's median ms per launch, the runs alternating round by round
    (drift on a shared machine hits them alike)."""
    per_launch: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for r, times in zip(runs, per_launch, strict=True):
            stats = r["engine"].run(r["trace"]).stats
            times.append(stats.decode_seconds / stats.launches * 1e3)
    for r, times in zip(runs, per_launch, strict=True):
        r["ms_per_launch"] = statistics.median(times)


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    info = machine()
    lines = [
        "# multi-step CPU capture: the step compiled once vs N inlined copies",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- command: `{CMD} --steps {','.join(map(str, args.steps))} --size {args.size}`",
        "- the embedded default model, one torch thread, inductor's caches off (every "
        f"capture cold), one capture size ({args.size}); ms/launch: median of "
        f"{args.rounds} greedy runs of {args.size} requests, the two programs alternating",
        "",
        "| N | program | capture s | vs inlined | ms/launch | vs inlined | tokens equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | {r['program']} | {r['capture_s']:.1f} | {r['capture_ratio']:.2f}x | "
            f"{r['ms_per_launch']:.3f} | {r['launch_ratio']:.2f}x | {r['equal']} |"
        )
    text = "\n".join(lines) + "\n"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "multistep-capture-cpu.md").write_text(text)
    payload = {"machine": info, "rows": rows}
    (RESULTS_DIR / "multistep-capture-cpu.json").write_text(json.dumps(payload, indent=2) + "\n")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")], default=[2, 8])
    p.add_argument("--size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    inductor_config.force_disable_caches = True
    rows: list[dict[str, Any]] = []
    with torch_threads(1):
        capture(2, 1)  # inductor's start-up, kept out of the first row
        for n in args.steps:
            base = capture(n, args.size)
            with step_once():
                once = capture(n, args.size)
            time_launches([base, once], args.rounds)
            torch.compiler.reset()
            for program, r in (("inlined", base), ("once", once)):
                rows.append(
                    {
                        "n": n,
                        "program": program,
                        "capture_s": r["capture_s"],
                        "capture_ratio": base["capture_s"] / r["capture_s"],
                        "ms_per_launch": r["ms_per_launch"],
                        "launch_ratio": base["ms_per_launch"] / r["ms_per_launch"],
                        "equal": r["out"] == base["out"],
                    }
                )
                print(rows[-1])
    print(write(rows, args))


if __name__ == "__main__":
    main()
