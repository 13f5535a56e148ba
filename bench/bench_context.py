"""Decode cost against the pool's capacity: the same live lengths at
``--max-context-len`` 128, 1024 and 8192, the full-width torch attention
(the reference, which reads every column of a row's capacity) against the
live-width attention (:mod:`graphrunner_ref.model.attention_live`, the CPU
default), on the eager and the compiled CPU runner, in the same run.

Each run serves the same 8 requests (prompts of 20-44 tokens, ``--new``
tokens each) arriving together, batch 8 (one captured size: finished rows
replay padded); tokens/s is the engine's steady-state decode (decode tokens
over the seconds inside the runner's replays: prefill excluded). Every run's
tokens are checked against the first run's. The ratio that matters is
the capacity-128 tokens/s over the capacity-8192 tokens/s of each row
(goal: at most 1.25).

``--model embedded`` (default: the embedded model, its context raised to the
largest capacity; random weights) or ``--model smollm2`` (SmolLM2-135M-Instruct,
fetched as ``make demo-real`` does, chat prompts). One torch thread.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_context [--model smollm2]``
(writes ``bench/results/context-<model>[-<tag>]-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.conftest import RESULTS_DIR, machine
from graphrunner.testing import torch_threads
from graphrunner_ref import Engine, Request, create_decode_runner, default_model
from graphrunner_ref.model import ModelBundle
from graphrunner_ref.model.default import default_config

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_context"
BATCH = 8
EXTRA_QUESTIONS = ["Why is the sky blue?", "Name a large city in Japan."]


def _embedded(capacity: int, largest: int) -> tuple[ModelBundle, list[tuple[int, ...]]]:
    config = dataclasses.replace(default_config(), max_position_embeddings=largest)
    bundle = default_model(max_requests=BATCH, max_context_len=capacity, config=config)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.linspace(20, 44, BATCH).round().long().tolist()
    prompts = [tuple(torch.randint(3, 250, (n,), generator=gen).tolist()) for n in lengths]
    return bundle, prompts


def smollm2_chats() -> tuple[Path, list[list[int]]]:
    """The SmolLM2 checkpoint ``make demo-real`` fetches and converts, and
    :data:`BATCH` chat prompts for it (token ids)."""
    from graphrunner_ref.cli.demo_real import PROMPTS, fetch_gguf
    from graphrunner_ref.io import read_config, resolve_checkpoint
    from graphrunner_ref.io.gguf_cache import cache_root
    from graphrunner_ref.io.text import TextCodec

    checkpoint = resolve_checkpoint(fetch_gguf(cache_root()))
    codec = TextCodec.load(checkpoint, what="bench", vocab_size=read_config(checkpoint).vocab_size)
    return checkpoint, [codec.chat(q) for q in (PROMPTS + EXTRA_QUESTIONS)[:BATCH]]


def long_prompts(prompts: list[list[int]], context: int) -> list[list[int]]:
    """Each prompt repeated (whole, then cut) to ``context`` tokens."""
    return [(p * (context // len(p) + 1))[:context] for p in prompts]


def _smollm2(capacity: int, largest: int) -> tuple[ModelBundle, list[tuple[int, ...]]]:
    from graphrunner_ref.io import load_model

    checkpoint, prompts = smollm2_chats()
    bundle = load_model(checkpoint, max_requests=BATCH, max_context_len=capacity)
    return bundle, [tuple(p) for p in prompts]


MODELS = {"embedded": _embedded, "smollm2": _smollm2}


def serve(
    model: str, kind: str, attention: str, capacity: int, largest: int, new: int
) -> dict[str, Any]:
    bundle, prompts = MODELS[model](capacity, largest)
    bundle.model.attn_backend.use(attention)
    return {
        "runner": kind,
        "attention": attention,
        "capacity": capacity,
        **run_batch(bundle, prompts, kind, new),
    }


def run_batch(bundle: Any, prompts: Sequence[Sequence[int]], kind: str, new: int) -> dict[str, Any]:
    """Capture size :data:`BATCH` of ``bundle`` on runner ``kind`` and serve the
    prompts (``new`` tokens each, arriving together): live lengths, decode
    tokens/s, capture seconds and each request's tokens."""
    runner = create_decode_runner(bundle, kind, capture_sizes=[BATCH], show_progress=False)
    start = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - start
    trace = [Request(i, tuple(p), new) for i, p in enumerate(prompts)]
    result = Engine(bundle, runner).run(trace)
    stats = result.stats
    return {
        "live": [len(p) for p in prompts],
        "tokens_per_s": stats.decode_tokens / stats.decode_seconds,
        "capture_s": capture_s,
        "outputs": {str(k): v for k, v in result.outputs.items()},
    }


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="embedded")
    p.add_argument("--capacities", type=_parse_ints, default=[128, 1024, 8192])
    p.add_argument("--runners", default="eager,cpu")
    p.add_argument("--attentions", default="torch,live")
    p.add_argument(
        "--torch-up-to",
        type=int,
        default=8192,
        help="the full-width torch attention only at capacities up to this (it is slow)",
    )
    p.add_argument("--new", type=int, default=48, help="new tokens per request (48)")
    p.add_argument("--tag", default="", help="added to the results file's name")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    largest = max(args.capacities)
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    with torch_threads(1):
        for kind in args.runners.split(","):
            for attention in args.attentions.split(","):
                for capacity in args.capacities:
                    if attention == "torch" and capacity > args.torch_up_to:
                        continue
                    row = serve(args.model, kind, attention, capacity, largest, args.new)
                    row["same_tokens"] = not rows or row["outputs"] == rows[0]["outputs"]
                    rows.append(row)
                    print(line(row), flush=True)
    result = record(
        f"{CMD} {' '.join(argv)}", rows, load_before, model=args.model, tag=args.tag, new=args.new
    )
    print(f"results written to {write(result)}")
    return 0 if all(r["same_tokens"] for r in rows) else 1


def record(
    command: str, rows: list[dict[str, Any]], load_before: float, new: int, **extra: Any
) -> dict[str, Any]:
    """A run's record: its command, the machine, ``extra`` facts, the rows and
    the load average before and now."""
    return {
        "command": command.strip(),
        "machine": machine(),
        **extra,
        "new_tokens": new,
        "batch": BATCH,
        "rows": rows,
        "load": [load_before, os.getloadavg()[0]],
    }


def line(r: dict[str, Any]) -> str:
    """One served row as the run prints it."""
    return (
        f"{r['runner']:6} {r['attention']:6} capacity {r['capacity']:5}: "
        f"{r['tokens_per_s']:8.1f} tok/s  (capture {r['capture_s']:.1f} s, "
        f"tokens {'same' if r['same_tokens'] else 'DIFFERENT'})"
    )


def write(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        f"# Decode tokens/s against the pool's capacity ({result['model']} model, CPU)",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- batch {result['batch']}, live prompt lengths {rows[0]['live']}, "
        f"{result['new_tokens']} new tokens each, one torch thread; steady-state decode",
        f"- load average before / after: {result['load'][0]:.1f} / {result['load'][1]:.1f} "
        f"(a shared {os.cpu_count()}-core machine)",
        "",
        *capacity_table(rows),
    ]
    tag = f"-{result['tag']}" if result["tag"] else ""
    out = RESULTS_DIR / f"context-{result['model']}{tag}-cpu.md"
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return str(out)


def capacity_table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table of ``rows`` (``runner``, ``attention``, ``capacity``,
    ``tokens_per_s``, ``same_tokens``): a line per runner and attention, a
    column per capacity, and the smallest capacity's tokens/s over the largest's."""
    caps = _caps(rows)
    lines = [
        "| runner | attention | "
        + " | ".join(f"cap {c}" for c in caps)
        + f" | cap {caps[0]} / cap {caps[-1]} | tokens |",
        "|---|---|" + "---|" * (len(caps) + 2),
    ]
    for kind, attention in dict.fromkeys((r["runner"], r["attention"]) for r in rows):
        mine = {
            r["capacity"]: r for r in rows if (r["runner"], r["attention"]) == (kind, attention)
        }
        cells = [f"{mine[c]['tokens_per_s']:.1f}" if c in mine else "-" for c in caps]
        ends = sorted(mine)
        ratio = mine[ends[0]]["tokens_per_s"] / mine[ends[-1]]["tokens_per_s"]
        same = all(r["same_tokens"] for r in mine.values())
        lines.append(
            f"| {kind} | {attention} | "
            + " | ".join(cells)
            + f" | {ratio:.2f}x | {'same' if same else 'DIFFERENT'} |"
        )
    return lines


def _caps(rows: list[dict[str, Any]]) -> list[int]:
    return sorted({r["capacity"] for r in rows})


if __name__ == "__main__":
    raise SystemExit(main())
