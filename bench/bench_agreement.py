"""How close the compact modes' logits stay to float32 transformers', teacher-forced.

The free-running agreement of :mod:`bench.bench_real_cpu` (leading greedy
tokens equal to transformers') hangs on a few near ties: one flipped pick and
the rest of the row parts. This bench removes that chance: each of the 8 chat
prompts is followed by transformers' own ``--new`` float32 greedy tokens, the
whole sequence is run once through each model, and at every one of the
``--new`` positions that predicts one of those tokens the logits are compared
with transformers' float32 ones:

- top-1: the share of positions whose greedy pick is transformers';
- logit RMS: the root mean square of the logits' differences;
- KL: the mean ``KL(transformers || who)`` of the next-token distributions.

Who: graphrunner's model (:func:`graphrunner_ref.io.load_model`) with
``--quantize int4`` (float32 activations, the exact mode) and ``int4-q8``
(activations quantized to 8 bits per group of 32), every position from one
prefill (the kernels' rows are independent of each other bit for bit, so a
position's logits are the ones a decode step at that position computes from
the same cache, up to the attention's order of sums); and llama.cpp on the
model's own Q4_1 GGUF file (its Q4_1 x Q8_1 product, float16 KV cache), where
``llama_cpp`` imports. One thread.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_agreement [--new 32]``
(writes ``bench/results/agreement-smollm2-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from bench.bench_context import smollm2_chats
from bench.bench_real_cpu import cpu_flags, kernel_facts, save_results, transformers_run
from bench.conftest import machine
from bench.llama_cpp_run import llama_cpp_available, llama_cpp_logits, llama_cpp_system
from graphrunner.testing import torch_threads
from graphrunner_ref.cli.demo_real import fetch_gguf
from graphrunner_ref.io import load_model
from graphrunner_ref.io.gguf_cache import cache_root
from graphrunner_ref.model.quantize import quantize_model

#: The graphrunner modes compared (``--quantize``).
MODES = ("int4", "int4-q8")


def transformers_logits(checkpoint: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """float32 transformers' logits ``[len, vocab]`` of each whole sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].float() for s in sequences]


def graphrunner_logits(
    checkpoint: Any, mode: str, sequences: list[list[int]]
) -> list[torch.Tensor]:
    """graphrunner's model under ``--quantize mode``: each sequence's logits
    ``[len, vocab]`` from one prefill into request slot 1."""
    longest = max(len(s) for s in sequences)
    bundle = load_model(checkpoint, max_requests=1, max_context_len=longest)
    quantize_model(bundle.model, mode)
    model: Any = bundle.model
    out = []
    for s in sequences:
        ids = torch.tensor(s)
        hidden = model.extend_hidden(1, ids, torch.arange(1, len(s) + 1))
        out.append(model.logits(hidden).float())
    return out


def compare(got: list[torch.Tensor], want: list[torch.Tensor], at: list[slice]) -> dict[str, float]:
    """Top-1 share, logit RMS and mean KL of ``got`` against ``want`` at the positions ``at``."""
    g = torch.cat([x[a] for x, a in zip(got, at, strict=True)]).double()
    w = torch.cat([x[a] for x, a in zip(want, at, strict=True)]).double()
    kl = F.kl_div(g.log_softmax(-1), w.log_softmax(-1), log_target=True, reduction="batchmean")
    return {
        "top1": float((g.argmax(-1) == w.argmax(-1)).double().mean()),
        "logit_rms": float((g - w).pow(2).mean().sqrt()),
        "kl": float(kl),
        "positions": int(g.shape[0]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=32, help="tokens after each prompt (32)")
    parser.add_argument("--out", default="agreement-smollm2-cpu", help="results file name")
    args = parser.parse_args(argv)
    if args.new < 1:
        parser.error(f"--new {args.new}: expected at least 1")
    with torch_threads(1):
        checkpoint, prompts = smollm2_chats()
        _, continuations = transformers_run(checkpoint, prompts, 1, args.new)
        sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
        # Position len(p) - 1 + i predicts continuation token i.
        at = [slice(len(p) - 1, len(p) - 1 + args.new) for p in prompts]
        want = transformers_logits(checkpoint, sequences)
        rows: list[dict[str, Any]] = []
        for mode in MODES:
            got = graphrunner_logits(checkpoint, mode, sequences)
            rows.append({"who": f"graphrunner --quantize {mode}", **compare(got, want, at)})
            print(rows[-1], flush=True)
        if llama_cpp_available():
            gguf = fetch_gguf(cache_root())
            got = [torch.from_numpy(x) for x in llama_cpp_logits(gguf, sequences)]
            rows.append({"who": f"llama.cpp on {gguf.name}", **compare(got, want, at)})
            print(rows[-1], flush=True)
    extra = kernel_facts(list(MODES))
    if llama_cpp_available():
        extra["llama.cpp"] = llama_cpp_system()
    result = {
        "command": "PYTHONPATH=. .venv/bin/python -m bench.bench_agreement " + " ".join(argv or []),
        "machine": {**machine(), "cpu flags": cpu_flags(), **extra},
        "new_tokens": args.new,
        "rows": rows,
    }
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    lines = [
        "# SmolLM2-135M-Instruct: compact modes' logits against float32 transformers', "
        "teacher-forced",
        "",
        f"- command: `{result['command'].strip()}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- 8 chat prompts, each followed by float32 transformers' {result['new_tokens']} greedy "
        "tokens; every position that predicts one of them compared (bench/bench_agreement.py)",
        "",
        "| who | top-1 as transformers | logit RMS error | mean KL |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['who']} | {r['top1']:.3f} ({round(r['top1'] * r['positions'])}/"
            f"{r['positions']}) | {r['logit_rms']:.3f} | {r['kl']:.2e} |"
        )
    return save_results(name, lines, result)


if __name__ == "__main__":
    sys.exit(main())
