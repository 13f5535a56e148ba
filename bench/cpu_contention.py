"""Whether this machine's CPUs are independent: one compute thread's speed
alone and beside a busy loop on another CPU.

A served benchmark runs the engine's compute thread beside the HTTP side and
the load generator. On a virtual machine two "cores" may be two hardware
threads of one physical core, or time-share one: then a Python loop that
touches no memory slows the compute thread as much as a second compute
thread would, and a served figure against an offline one measures the
neighbours as much as the server. This bench says which: two float32
products of a decode step's shape, one whose weights stay in L2 and one
that streams 64 MB of them (from L3 or memory, as a decode step streams its
weights)
(one torch thread, pinned to the first CPU), each timed alone and with a
pure-Python busy loop pinned to each other CPU, interleaved rounds, medians.
With ``--model CKPT`` (flags after ``--`` as ``graphrunner serve`` takes
them), also a whole decode step: one request of 256 prompt tokens and 64
new ones through the engine path ``generate`` runs (the runner's replay
time per decode step, :func:`bench.serve_load.offline`), alone and beside
the loop.

``PYTHONPATH=. .venv/bin/python -m bench.cpu_contention`` writes
``bench/results/cpu-contention-<cpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from bench.conftest import RESULTS_DIR, command, machine
from graphrunner_ref.model.cpu_features import cpu_features

#: Decode-shaped products, 8 rows each: against SmolLM2's MLP up projection
#: (its weights in L2) and against 64 MB of weights (streamed past L2).
PRODUCTS = {"in cache": (8, 576, 1536), "streamed": (8, 4096, 4096)}
BUSY = "import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"


def _gemm_ms(x: torch.Tensor, w: torch.Tensor, calls: int) -> float:
    """Median milliseconds of ``calls`` batches of 20 products."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        for _ in range(20):
            torch.mm(x, w)
        times.append((time.perf_counter() - start) / 20 * 1e3)
    return statistics.median(times)


def _busy(cpu: int, seconds: float) -> subprocess.Popen[bytes]:
    """A pure-Python loop on ``cpu`` for ``seconds`` (no memory traffic to speak of)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=seconds)])
    os.sched_setaffinity(proc.pid, {cpu})
    return proc


def measure(cpus: list[int], rounds: int, calls: int) -> dict[str, dict[str, float]]:
    """Per product, median ms on ``cpus[0]`` alone and beside a busy loop on each other CPU."""
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {cpus[0]})
    result: dict[str, dict[str, float]] = {}
    for name, (rows, inputs, outputs) in PRODUCTS.items():
        x, w = torch.randn(rows, inputs), torch.randn(inputs, outputs)
        _gemm_ms(x, w, calls)  # warm-up
        times: dict[str, list[float]] = {"idle": [], **{f"CPU {c}": [] for c in cpus[1:]}}
        for _ in range(rounds):
            times["idle"].append(_gemm_ms(x, w, calls))
            for cpu in cpus[1:]:
                proc = _busy(cpu, 60.0)
                time.sleep(0.2)  # the loop running before the timing starts
                times[f"CPU {cpu}"].append(_gemm_ms(x, w, calls))
                proc.kill()
                proc.wait()
        result[name] = {k: statistics.median(v) for k, v in times.items()}
    return result


def decode_steps(
    cpus: list[int], model: str, serve_args: list[str], rounds: int
) -> dict[str, float]:
    """Median ms of a decode step (the runner's replay) on ``cpus[0]`` alone
    and beside a busy loop on ``cpus[1]``."""
    from bench.serve_load import offline

    os.sched_setaffinity(0, {cpus[0]})
    args = argparse.Namespace(
        model=model, runner="cpu", threads=1, max_context_len=512, max_tokens=64,
        serve_args=serve_args,
    )  # fmt: skip
    rng = random.Random(0)
    prompt = [[rng.randrange(1, 200) for _ in range(256)]]
    times: dict[str, list[float]] = {"idle": [], f"CPU {cpus[1]}": []}
    for _ in range(rounds):
        times["idle"].append(offline(args, prompt, 8)["decode_step_ms"])
        proc = _busy(cpus[1], 600.0)
        try:
            times[f"CPU {cpus[1]}"].append(offline(args, prompt, 8)["decode_step_ms"])
        finally:
            proc.kill()
            proc.wait()
    return {k: statistics.median(v) for k, v in times.items()}


def report(result: dict[str, dict[str, float]], argv: Sequence[str] | None) -> list[str]:
    shapes = "; ".join(f"{n}: [{r}, {i}] x [{i}, {o}]" for n, (r, i, o) in PRODUCTS.items())
    lines = [
        "# One compute thread alone and beside a busy loop on another CPU",
        "",
        *(f"- {k}: {v}" for k, v in machine().items()),
        f"- CPU features: {cpu_features().describe()}",
        f"- command: `{command('cpu_contention', argv)}`",
        f"- float32 products ({shapes}), one torch thread pinned to the first CPU; "
        "a pure-Python busy loop pinned to another; medians of interleaved rounds",
        "",
        "| product | the other CPU | ms | vs alone |",
        "|---|---|---|---|",
    ]
    for name, times in result.items():
        alone = times["idle"]
        for where, ms in times.items():
            label = "idle" if where == "idle" else f"{where} running a Python loop"
            lines.append(f"| {name} | {label} | {ms:.3f} | {ms / alone:.2f}x |")
    lines += ["", *_verdict(result), ""]
    return lines


def _slowdown(times: dict[str, float]) -> float:
    return max(ms for ms in times.values()) / times["idle"]


def _verdict(result: dict[str, dict[str, float]]) -> list[str]:
    """What the rows say, in words: the products' worst slowdown, and the decode step's."""
    products = max(_slowdown(result[name]) for name in PRODUCTS)
    said = (
        f"Beside a loop that touches no memory, the products alone slow at most {products:.2f}x"
        + (
            ": the CPUs' arithmetic is independent."
            if products <= 1.2
            else ": the CPUs share a core."
        )
    )
    steps = [name for name in result if name not in PRODUCTS]
    for name in steps:
        slow = _slowdown(result[name])
        said += (
            f" A whole {name} slows {slow:.2f}x: a served figure on this machine (the load "
            "generator and the HTTP side running beside the engine) is held against an offline "
            "step that had the machine to itself."
            if slow > 1.2
            else f" A whole {name} keeps its speed ({slow:.2f}x)."
        )
    return [said]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--model", help="a checkpoint: also time its decode step")
    p.add_argument("--step-rounds", type=int, default=2, help="rounds of the decode step")
    p.add_argument("serve_args", nargs="*", help="after --: graphrunner serve's flags")
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("one CPU: nothing to contend with", file=sys.stderr)
        return 2
    result = measure(cpus, args.rounds, args.calls)
    if args.model:
        label = " ".join(["decode step", *args.serve_args])
        result[label] = decode_steps(cpus, args.model, args.serve_args, args.step_rounds)
    lines = report(result, argv)
    name = machine()["device"].lower()
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
    out = RESULTS_DIR / f"cpu-contention-{'-'.join(s for s in slug.split('-') if s)}"
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps({**result, "machine": machine()}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
