"""The Triton small-batch linears against torch's, on a GPU, per 1.1B-shape product.

For each product of a 1.1B-shape layer (norm + q/k/v, o + residual, norm +
gate/up + SiLU, down + residual) and the LM head, at 1, 4, 8 and 16 rows, in bfloat16, in one run:

* ``torch``: the modules' ops (RMSNorm, ``F.linear`` on cuBLAS, SiLU, multiply);
* ``triton``: :func:`~graphrunner_ref.model.kernels.gemv.gemv` with the tiling
  :func:`~graphrunner_ref.model.kernels.gemv.choose_blocks` picks;
* ``triton pdl``: ``triton`` launched programmatically (sm_90+), so each
  call of the graph overlaps its launch with the previous call's tail;
* ``triton bn=B``: the same with ``B`` output columns per program (the sweep
  that tunes ``choose_blocks``).

Each is captured in a CUDA graph of ``REPEATS`` calls (launch cost out) and
timed with CUDA events over ``ROUNDS`` replays, median; the weights' bytes
over that time give the bandwidth reached, beside the device-to-device copy
bandwidth measured in the same run. Every variant's output is first checked
against ``torch``'s. Results: ``bench/results/gemv-<device>.md``.

Run on a GPU: ``.venv/bin/python -m bench.bench_gemv`` (or
``bash bench/gpu_steps.sh gemv``). Without one it says so and exits 0.
"""

from __future__ import annotations

import datetime
import re
import statistics
import sys
from collections.abc import Callable

import torch

from bench.bench_gpu_model import RESULTS_DIR, copy_bandwidth
from graphrunner_ref.model import shape_1b_config
from graphrunner_ref.model.kernels.gemv import choose_blocks, gemv, reference
from graphrunner_ref.model.kernels.pdl import supported

ROWS = [1, 4, 8, 16]
REPEATS = 20
ROUNDS = 30
SWEEP = [4, 8, 16]


def products() -> dict[str, tuple[int, int, bool, bool, bool]]:
    """Name -> (N, K, norm, gated, residual) of the 1.1B shape's products, as
    the model runs them (:mod:`graphrunner_ref.model.small_batch`)."""
    c = shape_1b_config()
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return {
        "norm+qkv": (qkv, c.hidden_size, True, False, False),
        "o+residual": (c.hidden_size, c.num_heads * c.head_dim, False, False, True),
        "norm+gate/up+silu": (c.intermediate_size, c.hidden_size, True, True, False),
        "down+residual": (c.hidden_size, c.intermediate_size, False, False, True),
        "lm head": (c.vocab_size, c.hidden_size, False, False, False),
    }


def _graph_ms(fn: Callable[[], object]) -> float:
    """Median ms of one call, from a CUDA graph of REPEATS calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the operands are made on the default one
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn()
    times = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / REPEATS)
    return statistics.median(times)


def _variants(
    ops: dict[str, torch.Tensor | None], n: int, k: int
) -> dict[str, Callable[[], torch.Tensor]]:
    x, w = ops["x"], ops["w"]
    assert x is not None and w is not None
    kwargs = {"weight2": ops["w2"], "norm_weight": ops["g"], "residual": ops["r"], "eps": 1e-5}
    variants = {
        "torch": lambda: reference(x, w, **kwargs),  # type: ignore[arg-type]
        "triton": lambda: gemv(x, w, **kwargs),  # type: ignore[arg-type]
    }
    if supported(x.device):
        variants["triton pdl"] = lambda: gemv(x, w, pdl=True, **kwargs)  # type: ignore[arg-type]
    base = choose_blocks(x.shape[0], n, k)
    for bn in SWEEP:
        blocks = type(base)(
            base.block_m, bn, max(16, min(base.block_k, 8192 // (base.block_m * bn)))
        )
        variants[f"triton bn={bn}"] = lambda b=blocks: gemv(x, w, blocks=b, **kwargs)  # type: ignore[misc, arg-type]
    return variants


def measure() -> tuple[list[dict[str, object]], float]:
    bandwidth = copy_bandwidth()
    rows: list[dict[str, object]] = []
    for name, (n, k, norm, gated, residual) in products().items():
        gen = torch.Generator(device="cuda").manual_seed(n)

        def rand(*shape: int, g: torch.Generator = gen) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

        weights = {"w": rand(n, k), "w2": rand(n, k) if gated else None}
        g = rand(k) if norm else None
        nbytes = sum(t.numel() * 2 for t in weights.values() if t is not None)
        for m in ROWS:
            ops = {**weights, "x": rand(m, k), "g": g, "r": rand(m, n) if residual else None}
            variants = _variants(ops, n, k)
            want = variants["torch"]().float()
            for label, fn in variants.items():
                got = fn().float()
                torch.testing.assert_close(
                    got, want, rtol=2**-6, atol=2**-6 * want.abs().max().item()
                )
                ms = _graph_ms(fn)
                rows.append(
                    {"product": name, "rows": m, "variant": label, "us": ms * 1e3,
                     "pct_bandwidth": 100 * nbytes / (ms * 1e-3) / bandwidth}
                )  # fmt: skip
                print(rows[-1], flush=True)
    return rows, bandwidth


def write(rows: list[dict[str, object]], bandwidth: float) -> str:
    device = torch.cuda.get_device_name()
    torch_us = {(r["product"], r["rows"]): r["us"] for r in rows if r["variant"] == "torch"}
    lines = [
        f"# Small-batch linears: Triton against torch ({device})",
        "",
        f"torch {torch.__version__}, {datetime.date.today().isoformat()}, bfloat16, "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s. Command: "
        "`.venv/bin/python -m bench.bench_gemv`. µs per call (median of "
        f"{ROUNDS} replays of a graph of {REPEATS} calls); % of bandwidth: the "
        "weights' bytes over the time.",
        "",
        "| product | rows | variant | µs | % of copy bandwidth | torch / this |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = float(torch_us[(r["product"], r["rows"])]) / float(r["us"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['product']} | {r['rows']} | {r['variant']} | {r['us']:.1f} | "
            f"{r['pct_bandwidth']:.0f}% | {ratio:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"gemv-{slug}.md").write_text(text)
    return text


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_gemv: no CUDA device; nothing measured (run it on a GPU)")
        return 0
    print(write(*measure()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
