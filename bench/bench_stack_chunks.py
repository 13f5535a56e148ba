"""The CPU runner's decode at every caller depth, with and without
:class:`~graphrunner.util.stack_chunks.ChunkSafeCall`.

Inductor's Python wrapper calls an op through a small Python frame per layer
and projection; at some depths of the caller its own frame ends just short of
a CPython stack chunk, and each such call then maps and unmaps a chunk. The
sweep runs one short request (``--sweep-new`` tokens) from each depth of
``--depths`` (frames of a small recursion, more than a chunk's worth) and
counts the minor page faults per step of the second of two runs (the first
lets the guards settle at that depth), the programs and the engine's step
called plainly (``stack_chunks.ENABLED = False``) and through their guards
(the runner's launcher's and the engine loop's). The timing then
serves the 8 chat prompts (``--new`` tokens each) from the first depth where
the plain call faults, and from one where it does not, the two ways
interleaved for ``--rounds`` rounds (each round's order the last's reversed):
decode tokens/s, medians.

SmolLM2-135M-Instruct with ``--quantize int4-q8`` at batch 1, one thread, by
default (``--model embedded`` for the default model, no download).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_stack_chunks`` (writes
``bench/results/stack-chunks-cpu.md``). Not collected as a test.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from bench.bench_context import smollm2_chats
from bench.conftest import RESULTS_DIR, machine
from graphrunner.testing import torch_threads
from graphrunner.util import stack_chunks
from graphrunner_ref import Engine, Request, create_decode_runner, default_model, quantize_model
from graphrunner_ref.model.cpu_features import cpu_features, kernel_summary

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_stack_chunks"
WAYS = {"plain": False, "guarded": True}
T = TypeVar("T")


def at_depth(frames: int, fn: Callable[[], T]) -> T:
    """``fn()`` called ``frames`` frames deeper than this call."""
    return fn() if frames == 0 else at_depth(frames - 1, fn)


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def served(engine: Engine, trace: list[Request], guarded: bool) -> tuple[Any, int]:
    """The engine's result on ``trace`` and the page faults it took."""
    stack_chunks.ENABLED = guarded
    try:
        before = faults()
        result = engine.run(trace)
        return result, faults() - before
    finally:
        stack_chunks.ENABLED = True


def load(model: str, quantize: str | None) -> tuple[Any, list[tuple[int, ...]]]:
    if model == "embedded":
        bundle = default_model(max_requests=1, max_context_len=160)
        prompts = [tuple(range(3 + i, 40 + i)) for i in range(8)]
    else:
        checkpoint, chats = smollm2_chats()
        from graphrunner_ref.io import load_model

        bundle = load_model(checkpoint, max_requests=1, max_context_len=160)
        prompts = [tuple(p) for p in chats]
    if quantize is not None:
        quantize_model(bundle.model, quantize)
    return bundle, prompts


def sweep(engine: Engine, prompt: tuple[int, ...], depths: range, new: int) -> list[dict]:
    """Faults per decode step at each depth, each way."""
    rows = []
    for depth in depths:
        row: dict[str, Any] = {"depth": depth}
        for way, guarded in WAYS.items():
            trace = [Request(0, prompt, new)]
            for _ in range(2):  # the first run lets the guard settle at this depth
                result, n = at_depth(depth, lambda g=guarded, t=trace: served(engine, t, g))
            row[way] = n / result.stats.steps
        rows.append(row)
        print(f"depth {depth}: faults/step {row['plain']:.1f} plain, {row['guarded']:.1f} guarded")
    return rows


def timed(engine: Engine, trace: list[Request], depth: int, rounds: int) -> dict[str, Any]:
    """Decode tokens/s each way from ``depth``, interleaved; outputs compared."""
    tps: dict[str, list[float]] = {way: [] for way in WAYS}
    faults_per_step: dict[str, list[float]] = {way: [] for way in WAYS}
    outputs: dict[str, Any] = {}
    for round_ in range(rounds):
        order = list(WAYS.items())
        for way, guarded in order[:: -1 if round_ % 2 else 1]:  # ABBA: no order favoured
            result, n = at_depth(depth, lambda g=guarded: served(engine, trace, g))
            tps[way].append(result.stats.decode_tokens / result.stats.decode_seconds)
            faults_per_step[way].append(n / result.stats.steps)
            outputs[way] = [result.outputs[i] for i in range(len(trace))]
    medians = {way: statistics.median(v) for way, v in tps.items()}
    return {
        "depth": depth,
        **medians,
        **{f"{way} faults": statistics.median(v) for way, v in faults_per_step.items()},
        "ratio": medians["guarded"] / medians["plain"],
        "equal": outputs["plain"] == outputs["guarded"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2")
    p.add_argument("--quantize", default="int4-q8", help="a --quantize mode, or 'none'")
    p.add_argument("--depths", type=int, default=160, help="caller depths swept: 0..N-1")
    p.add_argument("--sweep-new", type=int, default=6)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default="stack-chunks-cpu")
    args = p.parse_args(argv)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * args.depths))
    quantize = None if args.quantize == "none" else args.quantize
    with torch_threads(1):
        bundle, prompts = load(args.model, quantize)
        runner = create_decode_runner(bundle, "cpu", capture_sizes=[1], show_progress=False)
        runner.capture()
        engine = Engine(bundle, runner)
        rows = sweep(engine, prompts[0], range(args.depths), args.sweep_new)
        bad = [r["depth"] for r in rows if r["plain"] > 4 * max(1.0, r["guarded"])]
        clean = [r["depth"] for r in rows if r["depth"] not in bad]
        trace = [Request(i, p, args.new) for i, p in enumerate(prompts)]
        timings = [timed(engine, trace, d, args.rounds) for d in (bad[:1] + clean[:1])]
    write(args, rows, bad, timings)
    return 0


def kernels(quantize: str) -> str:
    if quantize == "none":
        return "float32 projections (torch's)"
    return kernel_summary([quantize])


def write(args: argparse.Namespace, rows: list[dict], bad: list[int], timings: list[dict]) -> None:
    worst = max(rows, key=lambda r: r["guarded"])
    both = [r["depth"] for r in rows if min(r["plain"], r["guarded"]) > 20]
    lines = [
        "# The CPU runner's decode at every caller depth: plain calls and ChunkSafeCall's",
        "",
        f"- command: `{CMD}" + (f" {' '.join(sys.argv[1:])}`" if sys.argv[1:] else "`"),
        *(f"- {k}: {v}" for k, v in machine().items()),
        f"- CPU: {cpu_features().describe()}",
        f"- kernels: {kernels(args.quantize)}",
        f"- model: {args.model}, --quantize {args.quantize}, batch 1, one thread",
        "",
        f"Sweep: one request of {args.sweep_new} tokens from each caller depth 0..{args.depths - 1}"
        " (frames of a small recursion), run twice, the second counted; minor page faults per"
        " engine step.",
        "",
        f"- depths where the plain calls fault, guarded ones not: {bad or 'none'}",
        f"- most faults per step guarded, any depth: {worst['guarded']:.1f} (depth "
        f"{worst['depth']}); plain at its worst: {max(r['plain'] for r in rows):.1f}",
        f"- depths where both ways take over 20 a step: {both or 'none'}",
        "",
        f"Timing: the 8 chat prompts, {args.new} tokens each, {args.rounds} rounds, the two ways"
        " interleaved, each round's order the last's reversed; decode tokens/s and faults per"
        " step, medians. The timing's frames differ from the sweep's, so its depths are its"
        " own: each row's faults say whether the plain calls fault there.",
        "",
        "| caller depth (timing's) | faults/step plain, guarded | plain tok/s | guarded tok/s"
        " | guarded / plain | tokens equal |",
        "|---|---|---|---|---|---|",
        *(
            f"| {t['depth']} | {t['plain faults']:.1f}, {t['guarded faults']:.1f} | "
            f"{t['plain']:.1f} | {t['guarded']:.1f} | {t['ratio']:.2f}x | {t['equal']} |"
            for t in timings
        ),
    ]
    out = RESULTS_DIR / f"{args.out}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"results written to {out}")


if __name__ == "__main__":
    raise SystemExit(main())
