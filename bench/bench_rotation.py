"""The rotary embedding's formula under the compiled CPU runner: ``torch.cat``
of the halves against ``torch.roll`` with a signed ``sin`` (the shipped
:func:`~graphrunner_ref.model.layers.rotate`).

SmolLM2-135M-Instruct (the checkpoint ``make demo-real`` fetches) under
``--quantize int4-q8``, captured at batch 1 on the CPU runner twice, once
with each formula (the formula is read when the step is traced), then the 8
chat prompts decoded in alternating rounds, 32 tokens each, one torch
thread: decode tokens/s (the engine's decode steps whole), medians and the
median of the per-round ratios; both must give the same tokens.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_rotation --out NAME``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from bench.bench_context import smollm2_chats
from bench.bench_real_cpu import (
    GraphrunnerDecoder,
    ab_summary,
    alternate,
    at_least,
    kernel_facts,
    run_lines,
    run_record,
    save_results,
)
from bench.conftest import command
from graphrunner.testing import torch_threads
from graphrunner_ref.model import layers

NEW = 32
CAT, ROLL = "cat of the halves (before)", "roll, signed sin (shipped)"


def rotate_by_cat(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The formula before: ``x * cos + cat(-x[D/2:], x[:D/2]) * sin``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@contextmanager
def rotation(formula: Any) -> Iterator[None]:
    """``layers.rotate`` is ``formula`` inside (what a trace then reads)."""
    shipped = layers.rotate
    layers.rotate = formula
    try:
        yield
    finally:
        layers.rotate = shipped


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=at_least(2), default=8, help="alternating rounds (8)")
    p.add_argument("--out", default="rotation-cpu", help="results name under bench/results/")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    with torch_threads(1):
        checkpoint, prompts = smollm2_chats()
        decoders = {}
        for name, formula in ((CAT, rotate_by_cat), (ROLL, layers.rotate)):
            with rotation(formula):
                decoders[name] = GraphrunnerDecoder(checkpoint, prompts, "int4-q8", 1, NEW)
        speeds, tokens, _ = alternate(decoders, args.rounds)
    ran = command("bench_rotation", argv)
    result = run_record(ran, kernel_facts(["int4-q8"]), NEW, load, prompts, [])
    result.update(ab_summary(speeds, tokens, ROLL, CAT))
    result["same_tokens"] = result["same_tokens_every_round"] and tokens[CAT][0] == tokens[ROLL][0]
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    """The results file: the run's facts, each formula's median, the ratio."""
    medians = result["median"]
    lines = [
        "# SmolLM2-135M-Instruct, --quantize int4-q8, CPU runner, batch 1: the rotary's formula",
        "",
        *run_lines(result),
        f"- {result['rounds']} alternating rounds, 8 chat prompts, {result['new_tokens']} tokens "
        "each; decode tokens/s timing the engine's decode steps whole",
        "",
        "| formula | decode tok/s (median) | per round |",
        "|---|---|---|",
        *(
            f"| {n} | {medians[n]:.1f} | {', '.join(f'{v:.1f}' for v in vs)} |"
            for n, vs in result["tokens_per_s"].items()
        ),
        "",
        f"roll / cat, median of per-round ratios: **{result['ratio']:.3f}x**; "
        f"the same tokens: {'yes' if result['same_tokens'] else 'NO'}",
    ]
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
