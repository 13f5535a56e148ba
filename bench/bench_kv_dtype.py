"""The KV cache's dtype at long contexts: ``--kv-dtype float16`` against the
float32 cache under the compiled CPU runner, where the attention's reads of
the cache, not the weights, grow with the context.

SmolLM2-135M-Instruct (the checkpoint ``make demo-real`` fetches) under
``--quantize int4-q8`` (or ``--variant``), captured twice per batch size
(``bench_real_cpu``'s ``VARIANT`` and ``VARIANT-kv16``), each of the 8 chat
prompts repeated to ``--context`` tokens, 32 new tokens each, decoded in
alternating rounds, one torch thread: decode tokens/s (the engine's decode
steps whole), medians, the median of the per-round ratios, and how many rows
give the same tokens both ways.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_kv_dtype [--context 1024]
[--batches 1,8] [--rounds 4] [--out NAME]`` (writes ``bench/results/NAME.md``
and ``.json``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from bench.bench_context import long_prompts, smollm2_chats
from bench.bench_real_cpu import (
    KV_DTYPES,
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

NEW = 32


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=at_least(64), default=1024, help="prompt tokens (1024)")
    p.add_argument("--batches", type=batch_sizes, default="1,8", help="batch sizes (1,8)")
    p.add_argument("--rounds", type=at_least(2), default=4, help="alternating rounds (4)")
    p.add_argument(
        "--variant",
        choices=sorted(v for v in VARIANTS if f"{v}-kv16" in KV_DTYPES),
        default="int4-q8",
        help="the float32-cache variant, against its -kv16 twin (int4-q8)",
    )
    p.add_argument("--out", default="kv-dtype-cpu", help="results name under bench/results/")
    args = p.parse_args(argv)
    load = os.getloadavg()[0]
    names = (args.variant, f"{args.variant}-kv16")
    rows = []
    with torch_threads(1):
        checkpoint, chats = smollm2_chats()
        prompts = long_prompts(chats, args.context)
        for bs in args.batches:
            decoders = {n: GraphrunnerDecoder(checkpoint, prompts, n, bs, NEW) for n in names}
            speeds, tokens, _ = alternate(decoders, args.rounds, f"batch {bs}: ")
            row = {"batch": bs, **ab_summary(speeds, tokens, names[1], names[0])}
            first = [tokens[n][0] for n in names]
            row["rows_equal"] = sum(a == b for a, b in zip(*first, strict=True))
            rows.append(row)
    ran = command("bench_kv_dtype", argv)
    facts = kernel_facts([VARIANTS[args.variant][2]])
    result = run_record(ran, facts, NEW, load, prompts, rows)
    result["who"] = {n: VARIANTS[n][3] for n in names}
    print(f"results written to {write(result, args.out)}")
    return 0


def write(result: dict[str, Any], name: str) -> str:
    """The results file: the run's facts, then per batch size each cache's
    median, its rounds, the ratio and the rows whose tokens agree."""
    context = result["prompt_lengths"][0]
    lines = [
        f"# SmolLM2-135M-Instruct, CPU runner, prompts of {context} tokens: the KV cache's dtype",
        "",
        *run_lines(result),
        f"- alternating rounds, the 8 chat prompts each repeated to {context} tokens, "
        f"{result['new_tokens']} new tokens each; decode tokens/s timing the engine's decode "
        "steps whole",
        "",
        *ab_rounds_table(result["rows"], result["who"].__getitem__),
        "",
    ]
    lines += [
        f"- batch {row['batch']}: float16 cache / float32 cache, median of per-round ratios "
        f"**{row['ratio']:.3f}x** over {row['rounds']} rounds; rows with the same tokens both "
        f"ways: {row['rows_equal']}/8"
        for row in result["rows"]
    ]
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
