"""SmolLM2-135M-Instruct on the CPU through the transformers bridge: the
bridge against transformers' ``generate`` and ``generate_batch`` and against
graphrunner's native Llama, steady-state decode, in one run.

The same checkpoint, 8 chat prompts and protocol as :mod:`bench.bench_real_cpu`
(``--new`` greedy tokens each, the end token ignored, one torch thread; at
batch 8 the prompts decode together, at batch 1 one at a time). Rows
(``--rows``):

- ``generate``: transformers' ``generate`` (float32, sdpa), the baseline and
  the reference tokens; always run;
- ``generate_batch``: transformers' continuous batching (float32, sdpa over
  its paged cache; at most ``batch`` requests per step, the cache sized to the
  prompts);
- ``native`` / ``native-fp16``: the native Llama (``load_model``) on the CPU
  runner, float32 / float16 weights (``quantize_model``);
- ``bridge`` / ``bridge-fp16``: the checkpoint's own transformers modules
  (``load_transformers``) on the CPU runner, float32 / float16 weights
  (``graphrunner_ref.bridge.quantize_linears``).

Decode tokens/s excludes prefill: graphrunner's engine times its decode
replays; transformers' is (the new tokens after the first) over the time of
``--new`` tokens minus the time of 1 token on the same inputs, for
``generate`` and ``generate_batch`` alike (``generate_batch``'s per-token
timestamps give a second figure, written beside it). Every row's tokens are
compared with ``generate``'s float32 ones: rows whose tokens all agree, mean
leading tokens that agree. Ratios: against ``generate``, against
``generate_batch``, and bridge over native in the same weight dtype (goals:
the bridge >= 1.2x ``generate_batch`` in float32 and >= 2x with fp16
weights, bridge / native >= 0.83).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_bridge_cpu`` (writes
``bench/results/bridge-smollm2-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.bench_context import smollm2_chats
from bench.bench_real_cpu import (
    agreement,
    graphrunner_run,
    results_header,
    run_record,
    save_results,
    serve,
    transformers_run,
)
from graphrunner.testing import torch_threads
from graphrunner_ref.bridge import load_transformers, quantize_linears

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_bridge_cpu"
#: ``--rows`` names and their labels, in the order they run (the native row
#: of a dtype before its bridge row, so the bridge's ratio prints with it).
ROWS = {
    "generate": "transformers generate (float32, sdpa)",
    "generate_batch": "transformers generate_batch (float32, sdpa, paged cache)",
    "native": "graphrunner native Llama, cpu runner, float32",
    "bridge": "graphrunner transformers bridge, cpu runner, float32",
    "native-fp16": "graphrunner native Llama, cpu runner, fp16 weights",
    "bridge-fp16": "graphrunner transformers bridge, cpu runner, fp16 weights",
}
#: The graphrunner rows: (model, quantize mode or None).
GRAPHRUNNER = {
    "native": ("native", None),
    "bridge": ("bridge", None),
    "native-fp16": ("native", "fp16"),
    "bridge-fp16": ("bridge", "fp16"),
}
#: bench_real_cpu's ``--variants`` name of the native model per quantize mode.
NATIVE_VARIANT = {None: "cpu", "fp16": "fp16"}
#: transformers' continuous batching logger (its errors are checked per request).
CB_LOGGER = "ContinuousBatchingLogger"


def bridge_run(
    checkpoint: Path, prompts: list[list[int]], quantize: str | None, bs: int, new: int
) -> tuple[float, list[list[int]]]:
    """The bridge's decode tokens/s and each prompt's new tokens (prompt order):
    one captured size of ``bs``, a pool of ``bs`` requests."""
    context = max(len(p) for p in prompts) + new
    bundle = load_transformers(checkpoint, max_requests=bs, max_context_len=context)
    if quantize is not None:
        quantize_linears(bundle.model.hf, quantize)
    return serve(bundle, "cpu", prompts, bs, new)


def generate_batch_run(
    checkpoint: Path, prompts: list[list[int]], bs: int, new: int
) -> tuple[float, list[list[int]], float]:
    """transformers' continuous batching: decode tokens/s (``new`` tokens' time
    minus 1 token's), new tokens, and decode tokens/s from its timestamps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    _, first_s, _ = _generate_batch(model, prompts, bs, 1, new)
    outputs, all_s, spans_s = _generate_batch(model, prompts, bs, new, new)
    decode_tokens = len(prompts) * (new - 1)
    return decode_tokens / (all_s - first_s), outputs, decode_tokens / spans_s


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Logger ``name`` silenced (errors included) inside the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _generate_batch(
    model: Any, prompts: list[list[int]], bs: int, n: int, new: int
) -> tuple[list[list[int]], float, float]:
    """``n`` greedy tokens of each prompt from one ``generate_batch`` call (at
    most ``bs`` requests a step; the cache sized for ``new`` tokens, the same
    for every ``n``), its seconds, and the seconds its requests spent between
    their first and last token (the union of those spans)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pad = (
        model.config.eos_token_id
        if model.config.pad_token_id is None
        else model.config.pad_token_id
    )
    generation = GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=pad
    )
    cb = ContinuousBatchingConfig()
    context = max(len(p) for p in prompts) + new
    cb.num_blocks = len(prompts) * -(-context // cb.page_size)
    cb.max_batch_tokens = sum(sorted(len(p) for p in prompts)[-bs:])
    cb.max_requests_per_batch = bs
    # Without psutil it logs an error on the CPU's memory breakdown, which the
    # explicit sizes above make unused; a failed request is caught below.
    begin = time.perf_counter()
    with _quiet(CB_LOGGER):
        out = model.generate_batch(
            inputs=prompts,
            generation_config=generation,
            continuous_batching_config=cb,
            record_timestamps=True,
        )
    seconds = time.perf_counter() - begin
    results = list(out.values())
    bad = [r for r in results if r.error is not None or len(r.generated_tokens) != n]
    if len(results) != len(prompts) or bad:
        raise RuntimeError(f"generate_batch: {len(results)} results, failed: {bad[:1]}")
    return (
        [r.generated_tokens for r in results],
        seconds,
        _union([(r.timestamps[0], r.timestamps[-1]) for r in results]),
    )


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt (32)")
    p.add_argument("--batches", default="8,1")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument(
        "--out", default="bridge-smollm2-cpu", help="results file name under bench/results/"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    wanted = set(args.rows.split(","))
    if unknown := sorted(wanted - set(ROWS)):
        p.error(f"--rows {unknown[0]}: expected one of {', '.join(ROWS)}")
    if args.new < 2:
        p.error("--new: at least 2 (decode starts at the second token)")
    checkpoint, prompts = smollm2_chats()
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    with torch_threads(1):
        for bs in (int(b) for b in args.batches.split(",")):
            measured: dict[str, float] = {}
            for name, who in ROWS.items():
                extra: dict[str, Any] = {}
                if name == "generate":
                    tps, reference = transformers_run(checkpoint, prompts, bs, args.new)
                    tokens = reference
                elif name not in wanted:
                    continue
                elif name == "generate_batch":
                    tps, tokens, stamped = generate_batch_run(checkpoint, prompts, bs, args.new)
                    extra = {"tokens_per_s_timestamps": stamped}
                elif GRAPHRUNNER[name][0] == "native":
                    variant = NATIVE_VARIANT[GRAPHRUNNER[name][1]]
                    tps, tokens = graphrunner_run(checkpoint, prompts, variant, bs, args.new)
                else:
                    tps, tokens = bridge_run(
                        checkpoint, prompts, GRAPHRUNNER[name][1], bs, args.new
                    )
                measured[name] = tps
                row = {"bs": bs, "row": name, "who": who, "tokens_per_s": tps, **extra}
                rows.append({**row, **ratios(name, measured), **agreement(tokens, reference)})
                print(f"bs {bs} {describe(rows[-1], args.new)}", flush=True)
            for line in goals(measured):
                print(f"bs {bs} goal: {line}", flush=True)
    result = run_record(f"{CMD} {' '.join(argv)}", {}, args.new, load, prompts, rows)
    print(f"results written to {write(result, args.out)}")
    return 0


def ratios(name: str, measured: dict[str, float]) -> dict[str, float]:
    """Row ``name``'s tokens/s over ``generate``'s, ``generate_batch``'s (when
    measured) and, for a bridge row, over the native row of its dtype."""
    tps = measured[name]
    out = {"vs_generate": tps / measured["generate"]}
    if "generate_batch" in measured:
        out["vs_generate_batch"] = tps / measured["generate_batch"]
    native = name.replace("bridge", "native")
    if name.startswith("bridge") and native in measured:
        out["bridge_over_native"] = tps / measured[native]
    return out


def describe(row: dict[str, Any], new: int) -> str:
    """One row as a line: tokens/s, ratios, agreement."""
    parts = [f"{row['who']}: {row['tokens_per_s']:.1f} tok/s"]
    if "tokens_per_s_timestamps" in row:
        parts.append(f"({row['tokens_per_s_timestamps']:.1f} by its timestamps)")
    parts.append(f"{row['vs_generate']:.2f}x generate")
    if "vs_generate_batch" in row:
        parts.append(f"{row['vs_generate_batch']:.2f}x generate_batch")
    if "bridge_over_native" in row:
        parts.append(f"bridge/native {row['bridge_over_native']:.2f}")
    parts.append(
        f"{row['agree']}/8 rows and {row['prefix']:.1f} of {new} leading tokens as transformers"
    )
    return ", ".join(parts)


def goals(measured: dict[str, float]) -> list[str]:
    """The goals that this batch's rows can judge, each with its verdict."""
    checks = [
        ("bridge", "generate_batch", 1.2),
        ("bridge-fp16", "generate_batch", 2.0),
        ("bridge", "native", 0.83),
        ("bridge-fp16", "native-fp16", 0.83),
    ]
    return [
        f"{row} / {base} = {measured[row] / measured[base]:.2f} (goal >= {goal}: "
        f"{'met' if measured[row] / measured[base] >= goal else 'NOT met'})"
        for row, base, goal in checks
        if row in measured and base in measured
    ]


def write(result: dict[str, Any], name: str) -> str:
    """The results as ``bench/results/<name>.md`` and ``.json``; the .md path."""
    lines = [
        *results_header(
            result, "SmolLM2-135M-Instruct on the CPU: the transformers bridge, decode tokens/s"
        ),
        "| batch | who | decode tok/s | vs generate | vs generate_batch | bridge / native | "
        "rows as transformers | leading tokens as transformers |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ratio(row: dict[str, Any], key: str) -> str:
        return f"{row[key]:.2f}x" if key in row else "-"

    for r in result["rows"]:
        lines.append(
            f"| {r['bs']} | {r['who']} | {r['tokens_per_s']:.1f} | {ratio(r, 'vs_generate')} | "
            f"{ratio(r, 'vs_generate_batch')} | {ratio(r, 'bridge_over_native')} | "
            f"{r['agree']}/8 | {r['prefix']:.1f} of {result['new_tokens']} |"
        )
    lines += [""] + [
        f"- batch {r['bs']}: generate_batch's own per-token timestamps give "
        f"{r['tokens_per_s_timestamps']:.1f} tok/s (first to last token of its requests)"
        for r in result["rows"]
        if "tokens_per_s_timestamps" in r
    ]
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
