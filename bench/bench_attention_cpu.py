"""The CPU decode attention (``graphrunner_attention::decode``, float32, one
thread) against its torch reference and against the kernel's source at an
earlier commit, in one run.

For SmolLM2-135M's shape (3 KV heads, 3 query heads each, head size 64) and
Llama-3.2-1B's (8 KV heads, 4 query heads each, 64), at batch 1 and 8 and
``--contexts`` live tokens a row (slots scattered over a pool, as a paged
cache leaves them):

* ``torch``: :func:`~graphrunner_ref.model.attention_live.live_decode_attention`,
  the reference the kernel must equal;
* ``at REV`` (``--against REV``, default ``HEAD``): ``attention_cpu.cpp`` as
  committed at ``REV``, built beside the working tree's under a library name
  of its own;
* ``now``: the working tree's kernel.

Each output is first checked against the reference (``rtol 1e-5``); each is
timed as the median over ``--rounds`` rounds of calls, the candidates
interleaved within a round. ``now / at REV`` is the median of the per-round
ratios of their times. Results: ``bench/results/NAME.md`` (``--out``).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_attention_cpu --against HEAD``.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.bench_real_cpu import cpu_flags, round_order, save_results
from bench.conftest import machine
from graphrunner.testing import torch_threads
from graphrunner_ref.model.attention_cpu import (
    ATTENTION_SOURCE,
    cpp_attention_status,
    cpp_decode_attention,
)
from graphrunner_ref.model.attention_live import live_decode_attention
from graphrunner_ref.model.cpu_kernels import build_extension

#: (label, KV heads, query heads per KV head, head size).
SHAPES = (("SmolLM2-135M", 3, 3, 64), ("Llama-3.2-1B", 8, 4, 64))
#: Calls a round times, by context (fewer for longer ones).
CALLS = {64: 400, 256: 150, 1024: 40, 4096: 10}

Operands = tuple[torch.Tensor, ...]


def kernel_at(rev: str) -> tuple[Callable[..., torch.Tensor], str]:
    """``attention_cpu.cpp`` as committed at ``rev``, built under a library of
    its own (so it loads beside the working tree's): its ``decode`` op, and
    ``rev``'s short commit hash."""
    path = ATTENTION_SOURCE.relative_to(Path.cwd().resolve())
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True
        ).stdout
        sha = subprocess.run(
            ["git", "rev-parse", "--short", rev], capture_output=True, text=True, check=True
        ).stdout.strip()
    except subprocess.CalledProcessError as e:
        raise SystemExit(
            f"--against {rev}: git cannot read {path} there ({e.stderr.strip()})"
        ) from None
    library = f"graphrunner_attention_at_{sha}"
    source = re.sub(r"\bgraphrunner_attention\b", library, source)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "attention_at.cpp"
        file.write_text(source)
        why = build_extension(f"graphrunner_cpu_attention_at_{sha}", file)
    if why is not None:
        raise SystemExit(f"--against {rev}: its kernel did not build: {why}")
    return getattr(torch.ops, library).decode, sha


def operands(rows: int, kv_heads: int, group: int, dim: int, context: int) -> Operands:
    """``q [rows, kv_heads, group, dim]``, K and V pools with every row's
    ``context`` slots scattered among them (slot 0 the padding slot), and
    the row tables, seeded."""
    gen = torch.Generator().manual_seed(0)
    slots = rows * context + 1
    q = torch.randn(rows, kv_heads, group, dim, generator=gen)
    k = torch.randn(slots, kv_heads, dim, generator=gen)
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    table = torch.zeros(rows + 1, context, dtype=torch.int32)
    table[1:] = (torch.randperm(rows * context, generator=gen) + 1).view(rows, context)
    req = torch.arange(1, rows + 1)
    lens = torch.full((rows,), context, dtype=torch.int64)
    return q, k, v, table, req, lens


def time_round(fn: Callable[[], object], calls: int) -> float:
    """Microseconds a call, over ``calls`` calls."""
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - begin) / calls * 1e6


def measure(
    candidates: dict[str, Callable[..., torch.Tensor]], args: Operands, calls: int, rounds: int
) -> dict[str, list[float]]:
    """Each candidate's µs a call in each round (candidates interleaved,
    their order rotated a round: ``round_order``), after checking its output against the reference."""
    scale = args[0].shape[-1] ** -0.5
    want = live_decode_attention(*args, scale)
    for name, fn in candidates.items():
        torch.testing.assert_close(fn(*args, scale), want, rtol=1e-5, atol=1e-6, msg=name)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for r in range(rounds):
        for name in round_order(names, r):
            times[name].append(time_round(functools.partial(candidates[name], *args, scale), calls))
    return times


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default="HEAD", help="the commit whose kernel to compare (HEAD)")
    p.add_argument("--contexts", default="64,256,1024", help="live tokens a row (64,256,1024)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (15)")
    p.add_argument("--out", default="attention-cpu", help="results file under bench/results/")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    bad = [c for c in contexts if c not in CALLS]
    if bad:
        p.error(f"--contexts {bad[0]}: expected some of {', '.join(map(str, CALLS))}")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: expected at least 1")
    why = cpp_attention_status()
    if why is not None:
        print(f"the C++ attention cannot run here: {why}")
        return 0
    old, sha = kernel_at(args.against)
    candidates: dict[str, Callable[..., torch.Tensor]] = {
        "torch": live_decode_attention,
        "at": old,
        "now": cpp_decode_attention,
    }
    rows = []
    with torch_threads(1):
        for label, kv_heads, group, dim in SHAPES:
            for batch in (1, 8):
                for context in contexts:
                    ops = operands(batch, kv_heads, group, dim, context)
                    times = measure(candidates, ops, CALLS[context], args.rounds)
                    ratios = [a / n for a, n in zip(times["at"], times["now"], strict=True)]
                    row = {
                        "shape": label,
                        "batch": batch,
                        "context": context,
                        **{f"{k}_us": statistics.median(v) for k, v in times.items()},
                        "now_vs_at": statistics.median(ratios),
                        "rounds": times,
                    }
                    rows.append(row)
                    print(
                        f"{label} batch {batch} context {context}: torch {row['torch_us']:.1f}, "
                        f"at {args.against} {row['at_us']:.1f}, now {row['now_us']:.1f} µs "
                        f"({row['now_vs_at']:.2f}x)",
                        flush=True,
                    )
    command = "PYTHONPATH=. .venv/bin/python -m bench.bench_attention_cpu " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    result = {
        "command": command.strip(),
        "machine": {**machine(), "cpu flags": cpu_flags()},
        "against": f"{args.against} ({sha})" if sha != args.against else sha,
        "rows": rows,
    }
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    """The results table as ``bench/results/<name>.md`` (and its ``.json``)."""
    rev = result["against"]
    lines = [
        "# CPU decode attention: the kernel now against its source at "
        f"`{rev}` and the torch reference, one thread",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        "- µs a call, medians of interleaved rounds; ratio: the median of the per-round "
        f"ratios of `{rev}`'s time to now's",
        "",
        f"| shape | batch | context | torch µs | at `{rev}` µs | now µs | now vs `{rev}` |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['shape']} | {r['batch']} | {r['context']} | {r['torch_us']:.1f} | "
            f"{r['at_us']:.1f} | {r['now_us']:.1f} | {r['now_vs_at']:.2f}x |"
        )
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
