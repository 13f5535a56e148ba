"""The transformers bridge's decode cost against the pool's capacity:
SmolLM2-135M-Instruct through the bridge (``load_transformers``) at
``--max-context-len`` 128, 1024 and 4096 for the same live lengths, its
live-width attention (each row read up to the batch's longest live row,
:func:`graphrunner_ref.bridge.attention.live_rows_attention`) against the
full-width one it replaced (every row read over its whole capacity,
:func:`~graphrunner_ref.bridge.attention.rows_attention`), on the eager and
the compiled CPU runner, in the same run.

Each run serves :mod:`bench.bench_context`'s 8 chat prompts (``--new`` greedy
tokens each) arriving together, batch 8 (one captured size: finished rows
replay padded); tokens/s is the engine's steady-state decode (prefill
excluded). Every run's tokens are checked against the first run's. The ratio
that matters is each row's capacity-128 tokens/s over its capacity-4096
tokens/s (goal: at most 1.25 with the live width). One torch thread. On a
shared machine ``--repeat N`` serves every cell N times, the rounds
interleaved, and keeps each cell's best tokens/s (the one least slowed by
other work).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_bridge_context``
(writes ``bench/results/bridge-context-smollm2-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import graphrunner_ref.bridge.attention as bridge_attention
from bench.bench_context import BATCH, capacity_table, line, record, run_batch, smollm2_chats
from bench.conftest import RESULTS_DIR
from graphrunner.testing import torch_threads
from graphrunner_ref.bridge import load_transformers

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_bridge_context"
#: ``--attentions`` names: what each row of the table reads.
ATTENTIONS = {
    "live": "each row up to the batch's longest live row",
    "full": "each row's whole capacity (the bridge before the live width)",
}


@contextmanager
def _attention(name: str) -> Iterator[None]:
    """The bridge's CPU attention, ``live`` (its own) or ``full`` (the full-width
    one in its place), inside the block."""
    real = bridge_attention.live_rows_attention
    if name == "full":
        bridge_attention.live_rows_attention = bridge_attention.rows_attention  # type: ignore[assignment]
    try:
        yield
    finally:
        bridge_attention.live_rows_attention = real


def serve(
    checkpoint: Path, prompts: list[list[int]], kind: str, attention: str, capacity: int, new: int
) -> dict[str, Any]:
    """One run: capture size :data:`BATCH` on runner ``kind``, serve the prompts."""
    bundle = load_transformers(checkpoint, max_requests=BATCH, max_context_len=capacity)
    with _attention(attention):
        served = run_batch(bundle, prompts, kind, new)
    return {"runner": kind, "attention": attention, "capacity": capacity, **served}


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capacities", type=_parse_ints, default=[128, 1024, 4096])
    p.add_argument("--runners", default="eager,cpu")
    p.add_argument("--attentions", default="live,full")
    p.add_argument("--new", type=int, default=24, help="new tokens per request (24)")
    p.add_argument("--repeat", type=int, default=1, help="rounds; each cell keeps its best (1)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    checkpoint, prompts = smollm2_chats()
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    first: dict[str, Any] | None = None
    load_before = os.getloadavg()[0]
    with torch_threads(1):
        for _ in range(args.repeat):
            for kind in args.runners.split(","):
                for attention in args.attentions.split(","):
                    for capacity in args.capacities:
                        row = serve(checkpoint, prompts, kind, attention, capacity, args.new)
                        first = row["outputs"] if first is None else first
                        row["same_tokens"] = row["outputs"] == first
                        print(line(row), flush=True)
                        key = (kind, attention, capacity)
                        if key in best:
                            row["same_tokens"] = row["same_tokens"] and best[key]["same_tokens"]
                            if best[key]["tokens_per_s"] > row["tokens_per_s"]:
                                row = {**best[key], "same_tokens": row["same_tokens"]}
                        best[key] = row
    rows = list(best.values())
    result = record(f"{CMD} {' '.join(argv)}", rows, load_before, args.new, repeat=args.repeat)
    print(f"results written to {write(result)}")
    return 0 if all(r["same_tokens"] for r in rows) else 1


def write(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# The transformers bridge: decode tokens/s against the pool's capacity "
        "(SmolLM2-135M-Instruct, CPU)",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- batch {result['batch']}, live prompt lengths {rows[0]['live']}, "
        f"{result['new_tokens']} new tokens each, one torch thread; steady-state decode; "
        f"each cell the best of {result['repeat']} interleaved run(s)",
        f"- load average before / after: {result['load'][0]:.1f} / {result['load'][1]:.1f} "
        f"(a shared {os.cpu_count()}-core machine)",
        *(f"- attention `{k}`: {v}" for k, v in ATTENTIONS.items()),
        "",
        *capacity_table(rows),
    ]
    out = RESULTS_DIR / "bridge-context-smollm2-cpu.md"
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return str(out)


if __name__ == "__main__":
    raise SystemExit(main())
