"""The CPU decode attention's paths against each other at long contexts, in
one run, one torch thread: where this CPU has AVX-512, its path against the
AVX2 one, on each KV cache dtype (float32, float16, int8), each row's slots
in order or scattered over the pool.

A step's attention at SmolLM2-135M's shape (30 layers, 3 KV heads of 64, 3
query heads each), batch 8, every row holding ``--contexts`` tokens: one op
call a layer, each layer over its own KV, so the layers' caches together
outgrow the CPU's caches as a model's do. Each path's timings interleaved
round by round (the order rotated a round); medians; the ratio is the median
of the per-round AVX2 / AVX-512 times (above 1, AVX-512 is faster). The KV
bytes read a second are set beside a one-thread read of a 512 MB tensor
(``torch.sum``): this CPU's stream, the bound issue 71's item 3 names (70%).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_cpu_attention_paths
[--contexts 1024,4096] [--rounds 5] [--out NAME]`` (writes
``bench/results/NAME.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.bench_kv_int8 import LAYOUTS, attention_operands, stream_gbs
from bench.bench_real_cpu import cpu_flags, decode_path_note, round_order, save_results
from bench.conftest import command, machine
from graphrunner.testing import torch_threads
from graphrunner_ref.model.attention_cpu import cpp_attention_status, runnable_paths, using_path

#: The caches timed, by name.
CACHES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}
#: SmolLM2-135M's layers.
LAYERS = 30


def on_path(path: str, fn: Callable[[], object]) -> Callable[[], float]:
    """One timed call of ``fn`` (a step's attention) on ``path``, in seconds."""

    def run() -> float:
        with using_path(path):
            begin = time.perf_counter()
            fn()
            return time.perf_counter() - begin

    return run


def compare(paths: list[str], fn: Callable[[], object], rounds: int) -> dict[str, Any]:
    """Each path's step times over ``rounds`` interleaved rounds (a warm-up
    call each first), medians in ms and the median per-round ratio of the
    first path's time to the last's."""
    calls = {p: on_path(p, fn) for p in paths}
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {p: [] for p in paths}
    for r in range(rounds):
        for p in round_order(paths, r):
            times[p].append(calls[p]())
    ratios = [a / b for a, b in zip(times[paths[0]], times[paths[-1]], strict=True)]
    return {
        "ms": {p: statistics.median(t) * 1e3 for p, t in times.items()},
        "ratio": statistics.median(ratios),
        "rounds": times,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,4096", help="tokens a row (1024,4096)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (5)")
    p.add_argument("--out", default="cpu-attention-paths", help="results name under bench/results/")
    args = p.parse_args(argv)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        p.error(f"--contexts: {args.contexts!r}, expected whole numbers joined by commas")
    if min(contexts) < 1 or args.rounds < 1:
        p.error("--contexts and --rounds: expected whole numbers >= 1")
    why = cpp_attention_status()
    if why is not None:
        print(f"the C++ attention cannot run here: {why}")
        return 0
    chosen = decode_path_note()
    paths = runnable_paths()
    load = os.getloadavg()[0]
    rows = []
    with torch_threads(1):
        stream = stream_gbs()
        print(f"stream: {stream:.1f} GB/s (one thread); paths: {', '.join(paths)}", flush=True)
        for context in contexts:
            for layout in LAYOUTS:
                for name, dtype in CACHES.items():
                    fn, nbytes = attention_operands(dtype, context, LAYERS, layout)
                    row = compare(paths, fn, args.rounds)
                    row |= {"context": context, "layout": layout, "cache": name}
                    row["gbs"] = {q: nbytes / (ms / 1e3) / 1e9 for q, ms in row["ms"].items()}
                    rows.append(row)
                    del fn
                    print(
                        f"context {context}, {layout}, {name}: "
                        + ", ".join(
                            f"{q} {row['ms'][q]:.1f} ms ({row['gbs'][q]:.1f} GB/s)" for q in paths
                        )
                        + f", {row['ratio']:.2f}x",
                        flush=True,
                    )
    result = {
        "command": command("bench_cpu_attention_paths", argv),
        "machine": {**machine(), "cpu flags": cpu_flags(), "load average at start": f"{load:.2f}"},
        "path chosen here": chosen,
        "paths timed": paths,
        "stream_gbs": stream,
        "rows": rows,
    }
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    """The results file: the run's facts, then a row per context, layout
    and cache: each path's median ms (KV GB/s, share of the stream) and the
    ratio."""
    paths = result["paths timed"]
    stream = result["stream_gbs"]
    lines = [
        "# The CPU decode attention's paths, batch 8, one thread",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- path chosen on this CPU: {result['path chosen here']}",
        f"- one-thread stream (sum of 512 MB): {stream:.1f} GB/s",
        f"- a step's attention at SmolLM2-135M's shape: {LAYERS} layers, 3 KV heads of 64, "
        "3 query heads each, batch 8, a call a layer over that layer's own KV; medians of "
        f"interleaved rounds; ratio: the median per-round {paths[0]} / {paths[-1]} time",
        "",
        "| context | KV slots | cache | "
        + " | ".join(f"{q} ms (KV GB/s, of stream)" for q in paths)
        + f" | {paths[0]} / {paths[-1]} |",
        "|---|---|---|" + "---|" * len(paths) + "---|",
    ]
    for r in result["rows"]:
        cells = " | ".join(
            f"{r['ms'][q]:.1f} ({r['gbs'][q]:.1f}, {r['gbs'][q] / stream:.0%})" for q in paths
        )
        lines.append(
            f"| {r['context']} | {r['layout']} | {r['cache']} | {cells} | **{r['ratio']:.2f}x** |"
        )
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
