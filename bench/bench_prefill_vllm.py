"""Prefill against vLLM's CPU engine and against the core's GEMM peak.

One SmolLM2-135M prompt of 256, 1,024 and 4,096 tokens, one compute thread
each side, prefix caching off:

- graphrunner, eager: the model's prefill (``forward_extend``, the whole
  prompt in one call) in float32, bfloat16, int4-q8, and int4-q8 with
  ``--prefill-bf16`` (where the CPU has bfloat16 units), best of the rounds,
  the modes in turn;
- graphrunner, served: a request's time to its first token through the
  engine as ``graphrunner serve`` runs it (``--runner cpu``: each prompt
  chunk one compiled token-batch program, chunks of the default 2,048-token
  budget), in bfloat16, int4-q8 and int4-q8 with ``--prefill-bf16``;
- vLLM (``GRAPHRUNNER_VLLM_PYTHON``, :mod:`bench.vllm_cpu_run`): ``LLM.generate``
  of the prompt alone with ``max_tokens=1`` (its prefill and one token), in
  bfloat16 and float32, ``max_num_batched_tokens`` as large as the prompt so
  it prefills in one step as graphrunner does;
- the peak: one thread's best matrix product of each dtype at SmolLM2's
  prefill shapes (:func:`bench.bench_gemm_peak.gemm_rows`); a mode's share is
  the GFLOP/s of its linear layers over that peak (attention, whose cost
  grows with the prompt, is not counted in the FLOPs: a long prompt's share
  falls for it).

    GRAPHRUNNER_VLLM_PYTHON=... PYTHONPATH=. .venv/bin/python -m bench.bench_prefill_vllm

Writes ``bench/results/prefill-vllm-<cpu>-<unit>.md`` (and ``.json``;
:func:`~bench.bench_gemm_peak.cpu_slug`), naming the CPU, its features and
int4-q8's kernel path. Without vLLM, its columns say
so and graphrunner's rows are still measured.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from bench.bench_gemm_peak import (
    PREFILL_BF16,
    cpu_slug,
    gemm_rows,
    prefill_bundle,
    prefill_flops,
    q8_path_name,
)
from bench.conftest import RESULTS_DIR, command, machine
from bench.vllm_cpu_run import VllmDecoder, vllm_available, vllm_system
from graphrunner.testing import torch_threads
from graphrunner.util.atomic import write_atomically

LENGTHS = (256, 1024, 4096)
#: graphrunner's modes (eager, then served) and the dtype their GEMMs run in:
#: int4-q8's prompt chunks multiply 8-bit activations by its 4-bit weights
#: (its q/k/v projection bfloat16 where the CPU has it), which on a CPU
#: without AMX beats widening them to bfloat16.
MODES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "int4-q8": "int8",
    PREFILL_BF16: "bfloat16",
    "bfloat16, served": "bfloat16",
    "int4-q8, served": "int8",
    f"{PREFILL_BF16}, served": "bfloat16",
}
VLLM_DTYPES = ("bfloat16", "float32")


def _prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def ours(checkpoint: Any, prompts: list[list[int]], rounds: int) -> dict[str, list[float]]:
    """Each mode's best seconds per prompt (``forward_extend`` of it whole)."""
    from graphrunner_ref.model.prompt_bf16 import bf16_matmul_units

    modes = [m for m in MODES if m not in SERVED and (m != PREFILL_BF16 or bf16_matmul_units())]
    context = max(len(p) for p in prompts)
    bundles = {m: prefill_bundle(checkpoint, m, context) for m in modes}
    best = {m: [float("inf")] * len(prompts) for m in modes}
    for r in range(rounds + 1):  # round 0 warms
        for m, bundle in bundles.items():
            row = bundle.req_pool.alloc(1)[0]
            for i, prompt in enumerate(prompts):
                slots = bundle.kv_alloc.alloc(len(prompt))
                ids = torch.tensor(prompt)
                begin = time.perf_counter()
                with torch.no_grad():
                    bundle.model.forward_extend(row, ids, torch.tensor(slots))
                seconds = time.perf_counter() - begin
                bundle.kv_alloc.free(slots)
                if r:
                    best[m][i] = min(best[m][i], seconds)
            bundle.req_pool.free([row])
        print(f"graphrunner round {r}: " + ", ".join(
            f"{m} {[round(len(p) / s) for p, s in zip(prompts, best[m], strict=True)]}"
            for m in modes), flush=True)  # fmt: skip
    return best


#: The served modes: (label, EngineConfig fields).
SERVED = {
    "bfloat16, served": {"dtype": "bfloat16"},
    "int4-q8, served": {"quantize": "int4-q8", "kv_dtype": "float16"},
    f"{PREFILL_BF16}, served": {"quantize": "int4-q8", "prefill_bf16": True, "kv_dtype": "float16"},
}


def served(checkpoint: Any, prompts: list[list[int]], rounds: int) -> dict[str, list[float]]:
    """Each served mode's best seconds per prompt: ``add_request`` to the
    step that gives its first token, prefix caching off (each prompt afresh)."""
    from graphrunner_ref.engine.config import DEFAULT_BATCHED_TOKENS, EngineConfig
    from graphrunner_ref.engine.serving import build, open_engine
    from graphrunner_ref.model.prompt_bf16 import bf16_matmul_units

    context = max(len(p) for p in prompts) + 1
    sizes = sorted({min(len(p), DEFAULT_BATCHED_TOKENS) for p in prompts})
    out = {}
    for label, fields in SERVED.items():
        if fields.get("prefill_bf16") and not bf16_matmul_units():
            continue
        config = EngineConfig(
            model=None, checkpoint=checkpoint, runner="cpu", capture_sizes=(1,), quiet=True,
            max_num_batched_tokens=DEFAULT_BATCHED_TOKENS, token_capture_sizes=tuple(sizes),
            prefix_caching=False, **fields,
        )  # fmt: skip
        engine = open_engine(config, build(config, max_requests=1, context=context))
        best = [float("inf")] * len(prompts)
        for r in range(rounds + 1):  # round 0 warms
            for i, prompt in enumerate(prompts):
                begin = time.perf_counter()
                engine.add_request(prompt, 1)
                while not any(o.tokens for o in engine.step()):
                    pass
                seconds = time.perf_counter() - begin
                while engine.has_unfinished():
                    engine.step()
                if r:
                    best[i] = min(best[i], seconds)
        engine.close()
        out[label] = best
        print(f"graphrunner {label}: {[round(len(p) / s) for p, s in zip(prompts, best, strict=True)]}",
              flush=True)  # fmt: skip
    return out


def vllms(checkpoint: Any, prompts: list[list[int]], rounds: int) -> dict[str, list[float]]:
    """vLLM's best seconds per prompt in each dtype (empty without vLLM)."""
    if not vllm_available():
        return {}
    out = {}
    batched = max(len(p) for p in prompts) + 1
    for dtype in VLLM_DTYPES:
        engine = VllmDecoder(checkpoint, prompts, 1, 1, dtype, batched_tokens=batched)
        try:
            runs = [engine.prefill() for _ in range(rounds)]
        finally:
            engine.close()
        out[dtype] = [min(col) for col in zip(*runs, strict=True)]
        print(f"vLLM {dtype}: {[round(len(p) / s) for p, s in zip(prompts, out[dtype], strict=True)]}",
              flush=True)  # fmt: skip
    return out


def report(
    lengths: tuple[int, ...],
    mine: dict[str, list[float]],
    theirs: dict[str, list[float]],
    peak: dict[str, float],
    flops: dict[int, int],
    info: dict[str, str],
) -> str:
    lines = ["# Prefill: graphrunner against vLLM's CPU engine and the GEMM peak", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    head = "| prompt tokens | " + " | ".join(f"{m} tok/s" for m in mine)
    head += "".join(f" | vLLM {d} tok/s" for d in theirs)
    lines += ["", "Tokens per second (best of the rounds):", "", head + " |",
              "|" + "---|" * (1 + len(mine) + len(theirs))]  # fmt: skip
    for i, n in enumerate(lengths):
        cells = [f"{n / mine[m][i]:.0f}" for m in mine] + [
            f"{n / theirs[d][i]:.0f}" for d in theirs
        ]
        lines.append(f"| {n:,} | " + " | ".join(cells) + " |")
    lines += ["", "Each mode against vLLM at the same GEMM dtype (bfloat16 modes against "
              "vLLM bfloat16, float32 against float32; goal >= 1.2x) and against vLLM's "
              "fastest dtype at that length, and the linear layers' GEMM work over the "
              "whole prefill's time, as a share of the peak product of that dtype "
              "(attention and the rest count against it):", "",
              "| prompt tokens | mode | vs vLLM | vs vLLM's fastest | GFLOP/s | share of peak |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for i, n in enumerate(lengths):
        fastest = min((theirs[d][i] for d in theirs), default=None)
        for m, dtype in ((m, MODES[m]) for m in mine):
            ratio = f"{theirs[dtype][i] / mine[m][i]:.2f}x" if dtype in theirs else "no vLLM"
            best = "no vLLM" if fastest is None else f"{fastest / mine[m][i]:.2f}x"
            gflops = flops[n] / mine[m][i] / 1e9
            lines.append(
                f"| {n:,} | {m} | {ratio} | {best} | {gflops:.1f} | {gflops / peak[dtype]:.0%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (the best)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--min-seconds", type=float, default=0.3, help="timed per product")
    args = parser.parse_args(argv)
    from bench.bench_context import smollm2_chats
    from graphrunner_ref.model.attention_cpu import prompt_paths
    from graphrunner_ref.model.cpu_features import cpu_features, kernel_note

    checkpoint, _ = smollm2_chats()
    lengths = tuple(args.lengths)
    with torch_threads(1):
        gemms = gemm_rows(args.min_seconds)
        peak = {d: max(r["gflops"] for r in gemms if r["dtype"] == d) for d in set(MODES.values())}
        bundle = prefill_bundle(checkpoint, "float32", max(lengths))
        flops = {n: prefill_flops(bundle.model, n) for n in lengths}
        prompts = _prompts(bundle.config.vocab_size, lengths)
        del bundle
        mine = ours(checkpoint, prompts, args.rounds)
        mine |= served(checkpoint, prompts, args.rounds)
    theirs = vllms(checkpoint, prompts, args.rounds)
    features = cpu_features()
    info = {**machine(), "features": features.describe(), "threads": "1 each side",
            "int4-q8": f"{kernel_note('int4-q8')} ({q8_path_name()})",
            "prompt attention": prompt_paths(),
            "vLLM": vllm_system() if theirs else "not available (GRAPHRUNNER_VLLM_PYTHON unset)",
            "command": command("bench_prefill_vllm", argv)}  # fmt: skip
    text = report(lengths, mine, theirs, peak, flops, info)
    out = RESULTS_DIR / f"prefill-vllm-{cpu_slug(features)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out.with_suffix(".md"), text)
    data = {**info, "lengths": lengths, "graphrunner_s": mine, "vllm_s": theirs, "peak": peak}
    write_atomically(out.with_suffix(".json"), json.dumps(data, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
