"""What one core can do, and prefill's share of it.

First the limit: one thread's matrix products at SmolLM2-135M's prefill
shapes (a 512-token chunk against each projection: hidden 576, MLP 1,536,
K/V 192, the 49,152-token head) and at a square 1,024, in float32 and
bfloat16 (``torch.mm``: oneDNN, on AMX tiles or AVX-512 BF16 where the CPU
has them) and 8-bit integers (int8 x int8 -> int32; VNNI or AMX-INT8).
Then int4-q8's own product at the projections' shapes on the kernel path
this CPU takes (``amx-int8-tiles`` where it has AMX-INT8) against the
``avx512-vnni-tiles`` op over the same tiles, in the same run. Then SmolLM2's
eager prefill (``forward_extend``, one 512-token prompt) in float32,
bfloat16 and int4-q8, as GFLOP/s of its linear layers and as a share of the
best product of the dtype its GEMMs run in; where int4-q8 takes the AMX path,
again with AMX hidden (``GRAPHRUNNER_CPU_DISABLE=amx_int8``: the tiles path),
the modes timed in turn, round after round.

    PYTHONPATH=. .venv/bin/python -m bench.bench_gemm_peak

Writes ``bench/results/gemm-peak-<cpu>-<unit>.md`` (and ``.json``;
:func:`cpu_slug`), naming the CPU, its features and int4-q8's kernel path.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from bench.conftest import RESULTS_DIR, command, machine, slug
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
#: int4-q8 with its prompt chunks widened to bfloat16 (``--prefill-bf16``).
PREFILL_BF16 = "int4-q8, --prefill-bf16"
#: int4-q8's mode label with AMX hidden, and the features hidden for it.
TILES_ONLY = "int4-q8, AMX hidden"
HIDE_AMX = "amx_int8"
#: The shapes int4-q8's own product is timed at: its projections' at a
#: 512-row chunk, and gate/up at decode's 1 and 8 rows (the tiles path's
#: loop on either path: the ratio says the decode path is unchanged).
Q8_SHAPES = [s for s in SHAPES if s[0] in ("q/o proj", "k/v proj", "gate/up", "down")] + [
    ("gate/up, decode", 1, 576, 1536),
    ("gate/up, decode", 8, 576, 1536),
]


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


@contextmanager
def features_hidden(names: str) -> Iterator[None]:
    """Within: ``GRAPHRUNNER_CPU_DISABLE`` set to ``names``, the CPU's features
    and each product's kernel path read again (on entry and on exit)."""
    from graphrunner_ref.model.cpu_features import DISABLE_ENV, cpu_features, kernel_path

    before = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = names
    cpu_features.cache_clear()
    kernel_path.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = before
        cpu_features.cache_clear()
        kernel_path.cache_clear()


def q8_path_name() -> str:
    """The kernel path int4-q8 takes here (``torch`` where none runs)."""
    from graphrunner_ref.model.cpu_features import kernel_path

    path = kernel_path("int4-q8")
    return "torch" if path is None else path.name


def int4_q8_rows(min_seconds: float) -> list[dict[str, Any]]:
    """int4-q8's product at :data:`Q8_SHAPES` on this CPU's path (the op the
    module calls) and on the tiles op over the same tiles, timed in turn; empty
    where the module does not hold tiles (no AVX-512 VNNI: nothing to compare)."""
    from graphrunner_ref.model.int4_q8 import AMX_PATH, Int4Q8Linear

    ops = torch.ops.graphrunner_int4
    rows = []
    for label, m, k, n in Q8_SHAPES:
        gen = torch.Generator().manual_seed(m + k + n)
        linear = Int4Q8Linear(torch.randn(n, k, generator=gen) * 0.05)
        if not linear.tiled:
            return []
        x = torch.randn(m, k, generator=gen)
        args = (x, linear.tiles, linear.tile_scales, linear.tile_mins, n)
        path_op = ops.linear_q8_amx if linear.path == AMX_PATH else ops.linear_q8_tiled
        fns: dict[str, Callable[[], torch.Tensor]] = {
            "tiles": functools.partial(ops.linear_q8_tiled, *args),
            "path": functools.partial(path_op, *args),
        }
        if not torch.equal(fns["tiles"](), fns["path"]()):
            raise AssertionError(f"int4-q8 {linear.path_name} and the tiles op differ at {label}")
        best = {name: float("inf") for name in fns}
        for _ in range(5):  # in turn: the machine's noise falls on both
            for name, fn in fns.items():
                best[name] = min(best[name], best_seconds(fn, min_seconds / 5))
        gops = {name: 2 * m * k * n / sec / 1e9 for name, sec in best.items()}
        rows.append({"shape": label, "m": m, "k": k, "n": n, "path": linear.path_name,
                     "tiles_gops": gops["tiles"], "path_gops": gops["path"]})  # fmt: skip
        print(f"int4-q8 {label}: tiles {gops['tiles']:.1f}, {linear.path_name} "
              f"{gops['path']:.1f} GOP/s", flush=True)  # fmt: skip
    return rows


def prefill_bundle(checkpoint: Any, mode: str, context: int = PREFILL_TOKENS) -> Any:
    """SmolLM2 from ``checkpoint`` in ``mode`` (a key of :data:`PREFILL_MODES`,
    or :data:`PREFILL_BF16`), one request row of ``context`` tokens."""
    from graphrunner_ref.io import load_model
    from graphrunner_ref.model.quantize import quantize_model

    dtype = torch.bfloat16 if mode == "bfloat16" else torch.float32
    bundle = load_model(checkpoint, max_requests=1, max_context_len=context, dtype=dtype)
    if mode.startswith("int4-q8"):
        quantize_model(bundle.model, "int4-q8")
    if mode == PREFILL_BF16:
        from graphrunner_ref.model.prompt_bf16 import widen_prompts

        widen_prompts(bundle.model)
    return bundle


def prefill_rows(repeats: int) -> list[dict[str, Any]]:
    """Each mode's best of ``repeats`` prefills, the modes in turn each round;
    int4-q8 again with AMX hidden where it takes the AMX path."""
    from bench.bench_context import smollm2_chats

    checkpoint, _ = smollm2_chats()
    modes = dict(PREFILL_MODES)
    paths = {"float32": "", "bfloat16": "", "int4-q8": q8_path_name()}
    from graphrunner_ref.model.prompt_bf16 import bf16_matmul_units

    if bf16_matmul_units():
        modes[PREFILL_BF16], paths[PREFILL_BF16] = "bfloat16", "oneDNN bfloat16"
    bundles = {mode: prefill_bundle(checkpoint, mode) for mode in modes}
    if paths["int4-q8"] == "amx-int8-tiles":
        with features_hidden(HIDE_AMX):
            bundles[TILES_ONLY] = prefill_bundle(checkpoint, TILES_ONLY)
            modes[TILES_ONLY], paths[TILES_ONLY] = "int8", q8_path_name()
    runs = {}
    for mode, bundle in bundles.items():
        ids = torch.randint(3, bundle.config.vocab_size, (PREFILL_TOKENS,))
        row = bundle.req_pool.alloc(1)[0]
        slots = torch.tensor(bundle.kv_alloc.alloc(PREFILL_TOKENS))

        def prefill(
            bundle: Any = bundle, row: int = row, ids: torch.Tensor = ids, slots: Any = slots
        ) -> None:
            with torch.no_grad():
                bundle.model.forward_extend(row, ids, slots)

        prefill()  # warm
        runs[mode] = prefill
    best = {mode: float("inf") for mode in runs}
    for _ in range(repeats):
        for mode, prefill in runs.items():
            t0 = time.perf_counter()
            prefill()
            best[mode] = min(best[mode], time.perf_counter() - t0)
    rows = []
    for mode, seconds in best.items():
        flops = prefill_flops(bundles[mode].model, PREFILL_TOKENS)
        rows.append({"mode": mode, "gemm_dtype": modes[mode], "kernel_path": paths[mode],
                     "tokens": PREFILL_TOKENS, "seconds": seconds,
                     "tokens_per_s": PREFILL_TOKENS / seconds,
                     "gflops": flops / seconds / 1e9})  # fmt: skip
        print(f"prefill {mode}: {PREFILL_TOKENS / seconds:.0f} tokens/s", flush=True)
    return rows


def cpu_slug(features: Any) -> str:
    """A results file's machine: the CPU's name and its widest matrix unit
    (``amx``, ``avx512`` or ``avx2``), so that two machines of one name (a
    Xeon with AMX, and one whose hypervisor hides it) write apart."""
    unit = "amx" if features.has("amx_tile") else "avx512" if features.has("avx512f") else "avx2"
    return f"{slug(features.model)}-{unit}"


def report(
    gemms: list[dict[str, Any]],
    q8: list[dict[str, Any]],
    prefills: list[dict[str, Any]],
    info: dict[str, str],
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
    if q8:
        path = q8[0]["path"]
        lines += ["", f"int4-q8's product (4-bit weights x 8-bit rows), its "
                  f"`{path}` path against the `avx512-vnni-tiles` op over the same tiles, "
                  "in turn (equal outputs checked):", "",
                  f"| shape | M x K x N | avx512-vnni-tiles GOP/s | {path} GOP/s | ratio | "
                  "share of int8 peak |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in q8:
            lines.append(
                f"| {r['shape']} | {r['m']} x {r['k']} x {r['n']} | {r['tiles_gops']:.1f} | "
                f"{r['path_gops']:.1f} | {r['path_gops'] / r['tiles_gops']:.2f}x | "
                f"{r['path_gops'] / peak['int8']:.0%} |"
            )
    lines += ["", f"SmolLM2-135M eager prefill, one {PREFILL_TOKENS}-token prompt (GFLOP/s of its "
              "linear layers; the share is of the best product above in the dtype its GEMMs run "
              "in; the modes timed in turn, best of the rounds):", "",
              "| mode | kernel path | tokens/s | GFLOP/s | GEMM dtype | its peak GFLOP/s | "
              "share of peak | vs float32 |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    base = next(r["tokens_per_s"] for r in prefills if r["mode"] == "float32")
    for r in prefills:
        p = peak[r["gemm_dtype"]]
        lines.append(
            f"| {r['mode']} | {r['kernel_path'] or '-'} | {r['tokens_per_s']:.0f} | "
            f"{r['gflops']:.1f} | {r['gemm_dtype']} | {p:.1f} | {r['gflops'] / p:.0%} | "
            f"{r['tokens_per_s'] / base:.2f}x |"
        )
    by_mode = {r["mode"]: r["tokens_per_s"] for r in prefills}
    if TILES_ONLY in by_mode:
        lines += ["", f"int4-q8 prefill, AMX against AMX hidden: "
                  f"{by_mode['int4-q8'] / by_mode[TILES_ONLY]:.2f}x"]  # fmt: skip
    if PREFILL_BF16 in by_mode:
        lines += ["", f"int4-q8 prefill, --prefill-bf16 against without: "
                  f"{by_mode[PREFILL_BF16] / by_mode['int4-q8']:.2f}x"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-seconds", type=float, default=0.5, help="timed per product")
    parser.add_argument("--repeats", type=int, default=7, help="prefills per mode (the best)")
    args = parser.parse_args(argv)
    from graphrunner_ref.model.cpu_features import cpu_features, kernel_note

    with torch_threads(1):
        gemms = gemm_rows(args.min_seconds)
        q8 = int4_q8_rows(args.min_seconds)
        prefills = prefill_rows(args.repeats)
    features = cpu_features()
    info = {**machine(), "features": features.describe(), "threads": "1",
            "int4-q8": kernel_note("int4-q8"),
            "command": command("bench_gemm_peak", argv)}  # fmt: skip
    text = report(gemms, q8, prefills, info)
    out = RESULTS_DIR / f"gemm-peak-{cpu_slug(features)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out.with_suffix(".md"), text)
    write_atomically(
        out.with_suffix(".json"),
        json.dumps({**info, "gemm": gemms, "int4_q8": q8, "prefill": prefills}, indent=1),
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
