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
``--quantize int4`` (float32 activations, the exact mode), ``int4-q8``
(activations quantized to 8 bits per group of 32) and ``int4-bf16`` (weights
and activations rounded to bfloat16), every position from one
prefill (the kernels' rows are independent of each other bit for bit, so a
position's logits are the ones a decode step at that position computes from
the same cache, up to the attention's order of sums); and llama.cpp on the
model's own Q4_1 GGUF file (its Q4_1 x Q8_1 product, float16 KV cache), where
``llama_cpp`` imports. One thread.

Free-running, the same modes then decode each prompt's ``--new`` greedy
tokens from their own picks (graphrunner's model eagerly, one token a step
after the prefill; llama.cpp as :mod:`bench.bench_real_cpu` runs it, one
sequence at a time), and where a row first leaves transformers' tokens the
bench reads float32 transformers' own margin there: its top logit minus the
logit of the token the mode picked (the prefix up to that position is
transformers' own, so the teacher-forced logits above are the right ones).
A margin below the logit RMS error above is a near tie that either mode's
rounding may flip; the margins of all ``8 * --new`` positions are given
beside them (how many fall below 0.1, 0.25 and 0.5), so how often such ties
come is in view too.

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
from bench.bench_real_cpu import (
    cpu_flags,
    kernel_facts,
    leading_tokens,
    save_results,
    transformers_run,
)
from bench.conftest import command, machine
from bench.llama_cpp_run import (
    llama_cpp_available,
    llama_cpp_logits,
    llama_cpp_run,
    llama_cpp_system,
)
from graphrunner.testing import torch_threads
from graphrunner_ref.cli.demo_real import fetch_gguf
from graphrunner_ref.io import load_model
from graphrunner_ref.io.gguf_cache import cache_root
from graphrunner_ref.model.quantize import quantize_model

#: The graphrunner modes compared (``--quantize``).
MODES = ("int4", "int4-q8", "int4-q8-kv16", "int4-bf16")
#: A mode's suffix for a float16 KV cache (``--kv-dtype float16``).
KV16 = "-kv16"


def quantize_mode(mode: str) -> str:
    """The ``--quantize`` mode of a :data:`MODES` name (its :data:`KV16` dropped)."""
    return mode.removesuffix(KV16)


def who(mode: str) -> str:
    """A :data:`MODES` name as its row's label: the command line's options."""
    kv = " --kv-dtype float16" if mode.endswith(KV16) else ""
    return f"graphrunner --quantize {quantize_mode(mode)}{kv}"


def transformers_logits(checkpoint: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """float32 transformers' logits ``[len, vocab]`` of each whole sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].float() for s in sequences]


def quantized_model(checkpoint: Any, mode: str, context: int) -> Any:
    """graphrunner's model of ``checkpoint`` under ``--quantize mode`` (a
    :data:`MODES` name: with :data:`KV16`, a float16 KV cache), one request
    slot of ``context`` tokens."""
    kv_dtype = torch.float16 if mode.endswith(KV16) else None
    bundle = load_model(checkpoint, max_requests=1, max_context_len=context, kv_dtype=kv_dtype)
    quantize_model(bundle.model, quantize_mode(mode))
    return bundle.model


def graphrunner_logits(
    checkpoint: Any, mode: str, sequences: list[list[int]]
) -> list[torch.Tensor]:
    """graphrunner's model under ``--quantize mode``: each sequence's logits
    ``[len, vocab]`` from one prefill into request slot 1."""
    return model_logits(
        quantized_model(checkpoint, mode, max(len(s) for s in sequences)), sequences
    )


def model_logits(model: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """``model``'s (one request slot) logits ``[len, vocab]`` of each sequence,
    from one prefill into request slot 1."""
    out = []
    for s in sequences:
        ids = torch.tensor(s)
        hidden = model.extend_hidden(1, ids, torch.arange(1, len(s) + 1))
        out.append(model.logits(hidden).float())
    return out


def graphrunner_greedy(
    checkpoint: Any, mode: str, prompts: list[list[int]], new: int
) -> list[list[int]]:
    """graphrunner's model under ``--quantize mode``, eagerly: each prompt's
    ``new`` greedy tokens (its prefill, then one token a step, cache slot
    ``i + 1`` for position ``i``)."""
    model = quantized_model(checkpoint, mode, max(len(p) for p in prompts) + new)
    return model_greedy(model, prompts, new)


def model_greedy(model: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    """``model``'s (one request slot) ``new`` greedy tokens after each prompt,
    eagerly (its prefill, then one token a step, cache slot ``i + 1`` for
    position ``i``)."""
    out = []
    for prompt in prompts:
        hidden = model.extend_hidden(1, torch.tensor(prompt), torch.arange(1, len(prompt) + 1))
        picks = [int(model.logits(hidden[-1:]).argmax(-1))]
        for done in range(len(prompt), len(prompt) + new - 1):
            ids, slot = torch.tensor(picks[-1:]), torch.tensor([done + 1])
            hidden = model.extend_hidden(1, ids, slot, prefix_len=done)
            picks.append(int(model.logits(hidden).argmax(-1)))
        out.append(picks)
    return out


def top_margins(logits: list[torch.Tensor], at: list[slice]) -> torch.Tensor:
    """float32 transformers' top logit minus its second at each position of ``at``: ``[n]``."""
    top2 = torch.cat([x[a] for x, a in zip(logits, at, strict=True)]).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def divergences(
    tokens: list[list[int]],
    reference: list[list[int]],
    logits: list[torch.Tensor],
    at: list[slice],
) -> dict[str, Any]:
    """Rows of ``tokens`` equal to ``reference``, the mean count of leading
    tokens that agree, and where each other row first leaves ``reference``:
    (row, token index, the reference's top logit minus the picked token's
    logit there) from the reference's teacher-forced ``logits``."""
    firsts, leading = [], []
    for row, (got, want) in enumerate(zip(tokens, reference, strict=True)):
        i = leading_tokens(got, want)
        leading.append(i)
        if i < len(want):
            scores = logits[row][at[row].start + i]
            firsts.append((row, i, float(scores[want[i]] - scores[got[i]])))
    return {
        "rows_equal": len(tokens) - len(firsts),
        "leading": sum(leading) / len(leading),
        "first_divergences": firsts,
    }


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
            rows.append({"who": who(mode), **compare(got, want, at)})
            print(rows[-1], flush=True)
        if llama_cpp_available():
            gguf = fetch_gguf(cache_root())
            got = [torch.from_numpy(x) for x in llama_cpp_logits(gguf, sequences)]
            rows.append({"who": f"llama.cpp on {gguf.name}", **compare(got, want, at)})
            print(rows[-1], flush=True)
        free = free_running(checkpoint, prompts, continuations, want, at, args.new)
    extra = kernel_facts(sorted({quantize_mode(m) for m in MODES}))
    if llama_cpp_available():
        extra["llama.cpp"] = llama_cpp_system()
    result = {
        "command": command("bench_agreement", argv),
        "machine": {**machine(), "cpu flags": cpu_flags(), **extra},
        "new_tokens": args.new,
        "rows": rows,
        "free_running": free,
        "margins": margin_counts(top_margins(want, at)),
    }
    print(f"results written to {write(result, args.out)}")
    return 0


def free_running(
    checkpoint: Any,
    prompts: list[list[int]],
    reference: list[list[int]],
    logits: list[torch.Tensor],
    at: list[slice],
    new: int,
) -> list[dict[str, Any]]:
    """Each mode's (and llama.cpp's, where it imports) free-running greedy
    tokens against ``reference`` (transformers'): :func:`divergences`."""
    rows = []
    for mode in MODES:
        tokens = graphrunner_greedy(checkpoint, mode, prompts, new)
        rows.append({"who": who(mode), **divergences(tokens, reference, logits, at)})
        print(rows[-1], flush=True)
    if llama_cpp_available():
        gguf = fetch_gguf(cache_root())
        _, tokens = llama_cpp_run(gguf, prompts, 1, new)
        rows.append(
            {"who": f"llama.cpp on {gguf.name}", **divergences(tokens, reference, logits, at)}
        )
        print(rows[-1], flush=True)
    return rows


#: Bounds under which float32 transformers' top-2 margins are counted.
MARGIN_BOUNDS = (0.1, 0.25, 0.5)


def margin_counts(margins: torch.Tensor) -> dict[str, Any]:
    """How many of ``margins`` fall below each of :data:`MARGIN_BOUNDS`, and of how many."""
    below = {str(b): int((margins < b).sum()) for b in MARGIN_BOUNDS}
    return {"positions": int(margins.numel()), "below": below}


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
    lines += free_running_lines(result)
    return save_results(name, lines, result)


def free_running_lines(result: dict[str, Any]) -> list[str]:
    """The free-running table: rows, leading tokens and the float32 margins
    where each row first left transformers' tokens."""
    counts = result["margins"]
    below = ", ".join(f"{n} below {b}" for b, n in counts["below"].items())
    lines = [
        "",
        f"Free-running ({result['new_tokens']} greedy tokens from each mode's own picks); "
        "margin: float32 transformers' top logit minus the picked token's, where the row first "
        f"left transformers' tokens. Of all {counts['positions']} positions' top-2 margins: "
        f"{below}.",
        "",
        "| who | rows as transformers | leading tokens | first divergences (row, token, margin) |",
        "|---|---|---|---|",
    ]
    for r in result["free_running"]:
        firsts = ", ".join(f"({row}, {i}, {m:.3f})" for row, i, m in r["first_divergences"])
        lines.append(
            f"| {r['who']} | {r['rows_equal']}/8 | {r['leading']:.1f} of "
            f"{result['new_tokens']} | {firsts or '-'} |"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
