"""Which projections ``--quantize int4-q8`` feeds 8-bit inputs: agreement and speed.

SmolLM2-135M-Instruct (the checkpoint ``make demo-real`` fetches), its 8
chat prompts and float32 transformers' 32 greedy tokens after each, one
torch thread. Each configuration is int4-q8's model with the inputs of some
projection kinds (each layer's stacked q/k/v, output, stacked gate/up, down)
kept in float32 (int4's exact kernel, the same weights) and the rest
quantized to 8 bits (the LM head as the mode ships it):

- agreement: teacher-forced (each sequence whole: top-1, logit RMS and KL
  against transformers', ``bench/bench_agreement.py``'s measures) and
  free-running (each configuration's own greedy tokens: rows equal to
  transformers', mean leading tokens that agree);
- speed (``--rounds`` > 0): every projection 8-bit against int4-q8 as it
  ships, each captured at batch 1 on the CPU runner, decoding the prompts
  in alternating rounds; decode tokens/s (the engine's decode steps whole),
  medians and the median of the per-round ratios.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_q8_inputs --out NAME``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from bench.bench_agreement import (
    compare,
    divergences,
    model_greedy,
    model_logits,
    quantized_model,
    transformers_logits,
)
from bench.bench_context import smollm2_chats
from bench.bench_real_cpu import (
    EngineDecoder,
    ab_summary,
    alternate,
    at_least,
    kernel_facts,
    run_record,
    save_results,
    transformers_run,
)
from bench.conftest import command
from graphrunner.testing import torch_threads
from graphrunner_ref.io import load_model
from graphrunner_ref.model.int4_linear import Int4Linear, Int4Weight
from graphrunner_ref.model.int4_q8 import Int4Q8Linear
from graphrunner_ref.model.quantize import quantize_model

#: Each layer's compact linears by kind: (submodule, attribute).
KINDS = {
    "qkv": ("self_attn", "qkv_proj"),
    "o": ("self_attn", "o_proj"),
    "gate_up": ("mlp", "gate_up_proj"),
    "down": ("mlp", "down_proj"),
}

#: The configurations compared: a name and the kinds whose inputs stay float32.
CONFIGS = {
    "every projection 8-bit": (),
    "int4-q8 as shipped (q/k/v wider: bfloat16 with AVX-512 BF16, else float32)": None,
    "o float32": ("o",),
    "gate/up float32": ("gate_up",),
    "down float32": ("down",),
}

ALL_8BIT, SHIPPED = list(CONFIGS)[:2]
NEW = 32


def rebuilt(linear: Int4Linear, cls: type[Int4Linear]) -> Int4Linear:
    """``linear``'s weights (codes, scales, mins) in a fresh ``cls``."""
    fresh = cls(torch.zeros(linear.out_features, linear.in_features))
    fresh.set_rows(0, Int4Weight(linear.packed, linear.scales, linear.mins))
    return fresh


def with_float_inputs(model: Any, kinds: Sequence[str] | None) -> Any:
    """int4-q8's ``model`` with ``kinds``' inputs in float32 and every other
    kind's 8-bit (None: as :func:`quantize_model` made it); returns it."""
    if kinds is None:
        return model
    for layer in model.model.layers:
        for kind, (sub, attr) in KINDS.items():
            parent = cast(nn.Module, getattr(layer, sub))
            linear = cast(Int4Linear, getattr(parent, attr))
            want = Int4Linear if kind in kinds else Int4Q8Linear
            if type(linear) is not want:
                setattr(parent, attr, rebuilt(linear, want))
    return model


def agreement_rows(
    checkpoint: Any, prompts: list[list[int]], continuations: list[list[int]]
) -> list[dict[str, Any]]:
    """Each configuration's teacher-forced and free-running agreement."""
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    at = [slice(len(p) - 1, len(p) - 1 + NEW) for p in prompts]
    want = transformers_logits(checkpoint, sequences)
    context = max(len(s) for s in sequences)
    rows = []
    for name, kinds in CONFIGS.items():
        model = with_float_inputs(quantized_model(checkpoint, "int4-q8", context), kinds)
        with torch.no_grad():
            forced = compare(model_logits(model, sequences), want, at)
            tokens = model_greedy(model, prompts, NEW)
        rows.append({"who": name, **forced, **divergences(tokens, continuations, want, at)})
        print(rows[-1], flush=True)
    return rows


def decoder(checkpoint: Any, prompts: list[list[int]], kinds: Sequence[str] | None) -> Any:
    """A batch-1 CPU-runner engine over int4-q8's model with ``kinds``' inputs float32."""
    bundle = load_model(checkpoint, max_requests=1, max_context_len=max(map(len, prompts)) + NEW)
    quantize_model(bundle.model, "int4-q8")
    with_float_inputs(bundle.model, kinds)
    return EngineDecoder(bundle, "cpu", prompts, 1, NEW)


def speed_row(checkpoint: Any, prompts: list[list[int]], rounds: int) -> dict[str, Any]:
    """Every projection 8-bit against the shipped mode, ``rounds`` alternating rounds."""
    names = [ALL_8BIT, SHIPPED]
    contenders = {n: decoder(checkpoint, prompts, CONFIGS[n]) for n in names}
    speeds, tokens, _ = alternate(contenders, rounds)
    return ab_summary(speeds, tokens, SHIPPED, ALL_8BIT)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=at_least(0), default=6, help="speed rounds, 0 for none (6)")
    p.add_argument("--out", default="int4-q8-inputs-cpu", help="results name under bench/results/")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    with torch_threads(1):
        checkpoint, prompts = smollm2_chats()
        _, continuations = transformers_run(checkpoint, prompts, 1, NEW)
        rows = agreement_rows(checkpoint, prompts, continuations)
        speed = speed_row(checkpoint, prompts, args.rounds) if args.rounds else None
    ran = command("bench_q8_inputs", argv)
    result = run_record(ran, kernel_facts(["int4", "int4-q8"]), NEW, load, prompts, rows)
    result["speed"] = speed
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    """The results table (agreement per configuration, then the speed A/B)."""
    lines = [
        "# SmolLM2-135M-Instruct, --quantize int4-q8: which projections take 8-bit inputs",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- 8 chat prompts, {result['new_tokens']} tokens each; teacher-forced: float32 "
        "transformers' greedy tokens appended, every position predicting one compared; "
        "free-running: each configuration's own greedy tokens, eagerly",
        f"- load average before / after: {result['load'][0]:.1f} / {result['load'][1]:.1f}",
        "",
        "| inputs | top-1 | logit RMS | mean KL | rows as transformers | leading tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['who']} | {r['top1']:.3f} | {r['logit_rms']:.3f} | {r['kl']:.2e} | "
            f"{r['rows_equal']}/8 | {r['leading']:.1f} |"
        )
    speed = result["speed"]
    if speed is not None:
        lines += [
            "",
            f"Batch 1, CPU runner, {speed['rounds']} alternating rounds (decode tokens/s, "
            "median): "
            + ", ".join(f"{n} {v:.1f}" for n, v in speed["median"].items())
            + f"; shipped / every-8-bit, median of per-round ratios: **{speed['ratio']:.3f}x**"
            + ("" if speed["same_tokens_every_round"] else " (tokens differed between rounds)"),
        ]
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
