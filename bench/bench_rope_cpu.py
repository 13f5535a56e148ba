"""The rotary embedding and the KV write under the compiled CPU runner: the
model's torch ops (compiled by inductor into a gather, the rotation and two
scatters a layer) against the one C++ call that replaces them
(:func:`~graphrunner_ref.model.attention_cpu.cpp_rope_store`).

SmolLM2-135M-Instruct (the checkpoint ``make demo-real`` fetches) under
``--quantize int4-q8`` (or ``--variant``), captured on the CPU runner twice
per batch size, once each way (the choice is read when the step is traced:
:attr:`~graphrunner_ref.model.layers.RotaryEmbedding.table_rotation` off
keeps the torch ops), then the 8 chat prompts decoded in alternating rounds,
32 tokens each, one torch thread: decode tokens/s (the engine's decode steps
whole), medians and the median of the per-round ratios; both must give the
same tokens.

Measured in the step it runs in: compiled alone, with a pointwise stand-in
for the projection around them, inductor fused the torch ops into their
neighbours, which the step's extern projection and attention calls forbid.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_rope_cpu [--batches 1,8]
[--rounds 6] [--out NAME]`` (writes ``bench/results/NAME.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from bench.bench_context import smollm2_chats
from bench.bench_real_cpu import (
    VARIANTS,
    GraphrunnerDecoder,
    ab_rounds_table,
    ab_summary,
    alternate,
    at_least,
    batch_sizes,
    kernel_facts,
    run_lines,
    run_record,
    save_results,
)
from bench.conftest import command
from graphrunner.testing import torch_threads
from graphrunner_ref.model.attention_cpu import cpp_attention_status
from graphrunner_ref.model.layers import RotaryEmbedding

NEW = 32
TORCH_OPS, CPP_OP = "torch ops (before)", "C++ op (shipped)"


@contextmanager
def fused(on: bool) -> Iterator[None]:
    """Steps traced inside take the C++ op (``on``) or the torch ops."""
    shipped = RotaryEmbedding.table_rotation
    RotaryEmbedding.table_rotation = on
    try:
        yield
    finally:
        RotaryEmbedding.table_rotation = shipped


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=batch_sizes, default="1,8", help="batch sizes (1,8)")
    p.add_argument("--rounds", type=at_least(2), default=6, help="alternating rounds (6)")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="int4-q8", help="(int4-q8)")
    p.add_argument("--out", default="rope-store-cpu", help="results name under bench/results/")
    args = p.parse_args(argv)
    why = cpp_attention_status()
    if why is not None:
        p.error(f"the C++ op cannot run here: {why}")
    load = os.getloadavg()[0]
    rows = []
    with torch_threads(1):
        checkpoint, prompts = smollm2_chats()
        for bs in args.batches:
            decoders = {}
            for name, on in ((TORCH_OPS, False), (CPP_OP, True)):
                with fused(on):
                    decoders[name] = GraphrunnerDecoder(checkpoint, prompts, args.variant, bs, NEW)
            speeds, tokens, _ = alternate(decoders, args.rounds, f"batch {bs}: ")
            row = {"batch": bs, **ab_summary(speeds, tokens, CPP_OP, TORCH_OPS)}
            row["same_tokens"] = row["same_tokens_every_round"] and (
                tokens[TORCH_OPS][0] == tokens[CPP_OP][0]
            )
            rows.append(row)
    ran = command("bench_rope_cpu", argv)
    result = run_record(ran, kernel_facts([VARIANTS[args.variant][2]]), NEW, load, prompts, rows)
    result["variant"] = args.variant
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    """The results file: the run's facts, then per batch size each way's median,
    its rounds, the ratio and whether the tokens agree."""
    lines = [
        f"# SmolLM2-135M-Instruct, {result['variant']}, CPU runner: the rotary + KV write",
        "",
        *run_lines(result),
        f"- alternating rounds, 8 chat prompts, {result['new_tokens']} tokens each; decode "
        "tokens/s timing the engine's decode steps whole",
        "",
        *ab_rounds_table(result["rows"]),
        "",
    ]
    lines += [
        f"- batch {row['batch']}: C++ op / torch ops, median of per-round ratios "
        f"**{row['ratio']:.3f}x** over {row['rounds']} rounds; the same tokens: "
        f"{'yes' if row['same_tokens'] else 'NO'}"
        for row in result["rows"]
    ]
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
