"""What one core can do, and prefill's share of it.

First the limit: one thread's matrix products at SmolLM2-135M's prefill
shapes (a 512-token chunk against each projection: hidden 576, MLP 1,536,
K/V 192, the 49,152-token head) and at a square 1,024, in float32 and
bfloat16 (``torch.mm``: oneDNN, on AMX tiles or AVX-512 BF16 where the CPU
has them) and 8-bit integers (int8 x int8 -> int32; VNNI or AMX-INT8).
Then SmolLM2's eager prefill (``forward_extend``, one 512-token prompt) in
float32, bfloat16 and int4-q8, as GFLOP/s of its linear layers and as a
share of the best product of the dtype its GEMMs run in.

    PYTHONPATH=. .venv/bin/python -m bench.bench_gemm_peak

Writes ``bench/results/gemm-peak-<cpu>.md`` (and ``.json``), naming the CPU
and its features.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.conftest import RESULTS_DIR, command, machine
from graphrunner.testing import torch_threads
from graphrunner.util.atomic import write_atomically

#: (label, M, K, N): a 512-token chunk against SmolLM2's projections, and a square.
SHAPES = [
    ("q/o proj", 512, 576, 576),
    ("k/v proj", 512, 576, 192),
    ("gate/up", 512, 576, 1536),
    ("down", 512, 1536, 576),
    ("lm head", 512, 576, 49152),  # decode-like: a batch of rows against the head
    ("square", 1024, 1024, 1024),
]
PREFILL_TOKENS = 512
#: The prefill mode, the dtype of its GEMMs (whose peak it is held to).
PREFILL_MODES = {"float32": "float32", "bfloat16": "bfloat16", "int4-q8": "int8"}


def best_seconds(fn: Callable[[], Any], min_seconds: float, min_runs: int = 3) -> float:
    """The fastest of at least ``min_runs`` calls and ``min_seconds`` of them."""
    fn()  # warm: oneDNN picks and caches its kernel on the first call
    best, spent, runs = float("inf"), 0.0, 0
    while runs < min_runs or spent < min_seconds:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best


def _operands(dtype: str, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if dtype == "int8":
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
        b = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=gen)
        return a, b
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(m, k, generator=gen).to(torch_dtype)
    b = torch.randn(n, k, generator=gen).to(torch_dtype).t()  # a Linear's weight, transposed
    return a, b


def _product(dtype: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    # torch has no public int8 x int8 -> int32 product; _int_mm is the op
    # its own int8 paths call.
    return torch._int_mm if dtype == "int8" else torch.mm


def gemm_rows(min_seconds: float) -> list[dict[str, Any]]:
    rows = []
    for dtype in ("float32", "bfloat16", "int8"):
        product = _product(dtype)
        for label, m, k, n in SHAPES:
            a, b = _operands(dtype, m, k, n)
            seconds = best_seconds(lambda a=a, b=b, f=product: f(a, b), min_seconds)
            gflops = 2 * m * k * n / seconds / 1e9
            rows.append({"dtype": dtype, "shape": label, "m": m, "k": k, "n": n,
                         "seconds": seconds, "gflops": gflops})  # fmt: skip
            print(f"{dtype:>8} {label:>9} {m}x{k}x{n}: {gflops:8.1f} GFLOP/s", flush=True)
    return rows


def prefill_flops(model: torch.nn.Module, tokens: int) -> int:
    """The GEMM work of one prompt of ``tokens``: 2 x the decoder layers'
    linear weights per token, and the head once (only the last token's
    logits are computed); attention's scores are left out, small at 512."""
    config = model.config
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_layers
    kv = config.num_kv_heads * (config.head_dim or h // config.num_heads)
    per_layer = h * h * 2 + h * kv * 2 + h * i * 3
    return 2 * (tokens * layers * per_layer + h * config.vocab_size)


def prefill_rows(repeats: int) -> list[dict[str, Any]]:
    from bench.bench_context import smollm2_chats
    from graphrunner_ref.io import load_model
    from graphrunner_ref.model.quantize import quantize_model

    checkpoint, _ = smollm2_chats()
    rows = []
    for mode, gemm_dtype in PREFILL_MODES.items():
        dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
        bundle = load_model(checkpoint, max_requests=1, max_context_len=PREFILL_TOKENS, dtype=dtype)
        if mode == "int4-q8":
            quantize_model(bundle.model, mode)
        ids = torch.randint(3, bundle.config.vocab_size, (PREFILL_TOKENS,))
        row = bundle.req_pool.alloc(1)[0]
        slots = torch.tensor(bundle.kv_alloc.alloc(PREFILL_TOKENS))

        def prefill(
            bundle: Any = bundle, row: int = row, ids: torch.Tensor = ids, slots: Any = slots
        ) -> None:
            with torch.no_grad():
                bundle.model.forward_extend(row, ids, slots)

        seconds = best_seconds(prefill, 0.0, min_runs=repeats)
        flops = prefill_flops(bundle.model, PREFILL_TOKENS)
        rows.append({"mode": mode, "gemm_dtype": gemm_dtype, "tokens": PREFILL_TOKENS,
                     "seconds": seconds, "tokens_per_s": PREFILL_TOKENS / seconds,
                     "gflops": flops / seconds / 1e9})  # fmt: skip
        print(f"prefill {mode}: {PREFILL_TOKENS / seconds:.0f} tokens/s", flush=True)
    return rows


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def report(
    gemms: list[dict[str, Any]], prefills: list[dict[str, Any]], info: dict[str, str]
) -> str:
    peak = {
        d: max(r["gflops"] for r in gemms if r["dtype"] == d) for d in {r["dtype"] for r in gemms}
    }
    lines = ["# One core's matrix products, and prefill's share of them", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += ["", "| shape | M x K x N | float32 GFLOP/s | bfloat16 GFLOP/s | int8 GOP/s | bf16 / fp32 | int8 / fp32 |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, m, k, n in SHAPES:
        by = {r["dtype"]: r["gflops"] for r in gemms if r["shape"] == label}
        lines.append(
            f"| {label} | {m} x {k} x {n} | {by['float32']:.1f} | {by['bfloat16']:.1f} | "
            f"{by['int8']:.1f} | {by['bfloat16'] / by['float32']:.2f}x | "
            f"{by['int8'] / by['float32']:.2f}x |"
        )
    lines += ["", f"SmolLM2-135M eager prefill, one {PREFILL_TOKENS}-token prompt (GFLOP/s of its "
              "linear layers; the share is of the best product above in the dtype its GEMMs run in):", "",
              "| mode | tokens/s | GFLOP/s | GEMM dtype | its peak GFLOP/s | share of peak | vs float32 |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    base = next(r["tokens_per_s"] for r in prefills if r["mode"] == "float32")
    for r in prefills:
        p = peak[r["gemm_dtype"]]
        lines.append(
            f"| {r['mode']} | {r['tokens_per_s']:.0f} | {r['gflops']:.1f} | {r['gemm_dtype']} | "
            f"{p:.1f} | {r['gflops'] / p:.0%} | {r['tokens_per_s'] / base:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-seconds", type=float, default=0.5, help="timed per product")
    parser.add_argument("--repeats", type=int, default=3, help="prefills per mode (the best)")
    args = parser.parse_args(argv)
    from graphrunner_ref.model.cpu_features import cpu_features

    with torch_threads(1):
        gemms = gemm_rows(args.min_seconds)
        prefills = prefill_rows(args.repeats)
    features = cpu_features()
    info = {**machine(), "features": features.describe(), "threads": "1",
            "command": command("bench_gemm_peak", argv)}  # fmt: skip
    text = report(gemms, prefills, info)
    out = RESULTS_DIR / f"gemm-peak-{_slug(features.model)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out.with_suffix(".md"), text)
    write_atomically(
        out.with_suffix(".json"), json.dumps({**info, "gemm": gemms, "prefill": prefills}, indent=1)
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
