"""4-bit weights (``--quantize int4``) against float32, on the CPU, one thread.

For ``rows x 576`` times ``576 x 1536`` (a SmolLM2-135M gate/up projection,
its weight in cache) at 1 and 8 rows, and the same model's LM head
(``576 x 49152``, streamed from memory) as context, in one run:

* ``float32``: ``F.linear`` over the float32 weight (the baseline);
* ``fp16``: :class:`~graphrunner_ref.model.fp16_linear.Fp16WeightLinear`
  (``--quantize fp16``, the C++ kernel), for comparison;
* ``int8 groups``: :class:`~graphrunner_ref.model.int8_linear.Int8GroupLinear`
  (int8 in groups of 32, float32 activations: int4-q8's LM head);
* ``int4 torch``: dequantize to float32, then ``F.linear``
  (:func:`~graphrunner_ref.model.int4_linear.int4_reference_linear`);
* ``int4 aten``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` over the same
  codes (its ``(q - 8) * scale + zero`` format, ``zero = min + 8 * scale``);
* ``int4 kernel``: the C++ AVX2 kernel
  (``torch.ops.graphrunner_int4.linear``, built on first use);
* ``int4-q8 <path>``: the same codes times activations quantized to 8 bits
  per group of 32 (``--quantize int4-q8``, ``torch.ops.graphrunner_int4.linear_q8``),
  once for each kernel path this CPU runs (``cpu_features.KERNEL_PATHS``; the
  tiles path over its own layout, ``linear_q8_tiled``);
* ``int4-bf16`` and ``int8 groups bf16`` (where AVX-512 BF16 runs): the same
  codes, weights and activations rounded to bfloat16 (``--quantize int4-bf16``
  and its LM head; int4-q8's q/k/v and head there);
* ``bf16 onednn`` (where the CPU multiplies bfloat16 natively: AVX-512 BF16
  or AMX): oneDNN's bfloat16 product over the weight prepacked once, the
  activations rounded to bfloat16 and the output widened back, as vLLM's CPU
  engine runs a bfloat16 model's linears: the matrix units' figure, for context.

Every candidate's output is first checked against ``int4 torch`` (atol 1e-4
times the output's largest magnitude), the int4-q8 ones against
:func:`~graphrunner_ref.model.int4_q8.int4_q8_reference_linear` (atol 2e-6);
their error column is then the activations' rounding. Each is timed as the median over
``ROUNDS`` rounds of ``CALLS`` calls, candidates interleaved per round.
Results: ``bench/results/int4-cpu.md`` (a Zen 4 EPYC),
``bench/results/int4-q8-avx2-cpu.md`` (an AVX2 EPYC, int4-q8 beside int4).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_int4 [--out NAME]``
(``bench/results/NAME.md``, ``int4-cpu`` by default).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.conftest import command
from graphrunner_ref.model.cpu_features import (
    KERNEL_PATHS,
    KernelPath,
    cpu_features,
    half_precision_units,
    kernel_path,
    kernel_summary,
)
from graphrunner_ref.model.fp16_linear import Fp16WeightLinear
from graphrunner_ref.model.int4_linear import (
    GROUP,
    block_codes,
    int4_kernel_status,
    int4_reference_linear,
    quantize_int4,
)
from graphrunner_ref.model.int4_q8 import (
    AMX_PATH,
    TILES_PATHS,
    int4_q8_reference_linear,
    tile_codes,
)
from graphrunner_ref.model.int8_linear import Int8GroupLinear

RESULTS = Path(__file__).parent / "results"
#: (label, out, in, rows) of each product.
PRODUCTS = [
    ("576x1536", 1536, 576, 1),
    ("576x1536", 1536, 576, 8),
    ("1536x576 (down)", 576, 1536, 1),
    ("1536x576 (down)", 576, 1536, 8),
    ("576x49152 (LM head)", 49152, 576, 1),
    ("576x49152 (LM head)", 49152, 576, 8),
]
ROUNDS = 15
#: Candidates that multiply other weights or round the activations: their error
#: column is that rounding, not checked against ``int4 torch``.
ROUNDED = ("float32", "fp16", "int8 groups", "bf16 onednn", "int4-bf16", "int8 groups bf16")
#: Calls per round: enough for ~a few ms per round on the small product.
CALLS = {1536: 50, 576: 50, 49152: 3}
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu_facts() -> dict[str, str]:
    """The CPU's model name, its SIMD flags that matter here and torch's view of it."""
    name, flags = platform.processor() or platform.machine(), set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": name,
        "flags": " ".join(f for f in _FLAGS if f in flags) or "(unknown)",
        "torch capability": torch.backends.cpu.get_cpu_capability(),
        "half-precision units": ", ".join(half_precision_units()) or "none",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def candidates(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> ``x [rows, in] -> [rows, out]`` for weight ``w`` ``[out, in]``."""
    packed, scales, mins = quantize_int4(w)
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "float32": lambda x: F.linear(x, w),
        "fp16": Fp16WeightLinear(w),
        "int8 groups": Int8GroupLinear(w),
        "int4 torch": lambda x: int4_reference_linear(x, packed, scales, mins),
    }
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and w.shape[1] % GROUP == 0:
        b = packed.view(w.shape[0], -1, 16)
        codes = torch.cat([b & 0x0F, b >> 4], dim=2).reshape(w.shape[0], -1).to(torch.int32)
        aten_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        sz = torch.stack([scales.T, (mins + 8 * scales).T], dim=-1).contiguous()
        out["int4 aten"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, aten_packed, GROUP, sz
        )
    if half_precision_units() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        out["bf16 onednn"] = bf16_onednn(w)
    if int4_kernel_status() is None:
        blocked = block_codes(packed)
        out["int4 kernel"] = lambda x: torch.ops.graphrunner_int4.linear(x, blocked, scales, mins)
        for path in q8_paths():
            out[f"int4-q8 {path.name}"] = q8_product(path, packed, scales, mins)
        if kernel_path("int4-bf16") is not None:
            out["int4-bf16"] = lambda x: torch.ops.graphrunner_int4.linear_bf16(
                x, blocked, scales, mins
            )
            grouped = Int8GroupLinear(w)
            out["int8 groups bf16"] = lambda x: torch.ops.graphrunner_int8.linear_grouped_bf16(
                x, grouped.weight, grouped.scales
            )
    return out


def q8_product(
    path: KernelPath, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """int4-q8's product on ``path`` over the codes in that path's layout."""
    if path.code in TILES_PATHS:
        tiles, tile_scales, tile_mins = tile_codes(packed, scales, mins)
        ops = torch.ops.graphrunner_int4
        return functools.partial(
            ops.linear_q8_amx if path.code == AMX_PATH else ops.linear_q8_tiled,
            tiles=tiles,
            tile_scales=tile_scales,
            tile_mins=tile_mins,
            out=scales.shape[0],
        )
    return functools.partial(
        torch.ops.graphrunner_int4.linear_q8,
        blocked=block_codes(packed),
        scales=scales,
        mins=mins,
        path=path.code,
    )


def bf16_onednn(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x [rows, in]`` float32 -> float32 through oneDNN's bfloat16 product
    over ``w`` ``[out, in]`` prepacked once for this CPU."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
    return lambda x: torch.ops.mkldnn._linear_pointwise(
        x.bfloat16(), packed, None, "none", [None], ""
    ).float()


def q8_paths() -> list[KernelPath]:
    """The int4-q8 kernel paths this CPU has and this build compiled."""
    compiled = int(torch.ops.graphrunner_int4.q8_paths())
    return [
        p
        for p in KERNEL_PATHS
        if p.product == "int4-q8" and cpu_features().has(*p.needs) and compiled >> p.code & 1
    ]


def _median_us(fn: Callable[[], object], calls: int, rounds: list[float]) -> None:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    rounds.append((time.perf_counter() - t0) / calls * 1e6)


def measure(out: int, inp: int, rows: int) -> dict[str, tuple[float, float]]:
    """Name -> (median µs, max |error| vs ``int4 torch`` / output scale)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out, inp, generator=gen) * 0.05
    x = torch.randn(rows, inp, generator=gen)
    fns = candidates(w)
    ref = fns["int4 torch"](x)
    scale = float(ref.abs().max())
    packed, scales, mins = quantize_int4(w)
    q8_ref = int4_q8_reference_linear(x, packed, scales, mins)
    errors = {}
    for name, fn in fns.items():
        y = fn(x)
        err = float((y - ref).abs().max()) / scale
        if name.startswith("int4-q8"):
            q8_err = float((y - q8_ref).abs().max()) / scale
            if q8_err > 2e-6:
                raise AssertionError(f"{name}: max error {q8_err:.2e} x output scale vs reference")
        elif name not in ROUNDED and err > 1e-4:
            raise AssertionError(f"{name}: max error {err:.2e} x output scale vs int4 torch")
        errors[name] = err
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        for _ in range(3):
            fn(x)
    calls = CALLS[out]
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            _median_us(functools.partial(fn, x), calls, times[name])
    return {name: (statistics.median(t), errors[name]) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="int4-cpu", help="results name under bench/results/")
    path = RESULTS / f"{p.parse_args(argv).out}.md"
    torch.set_num_threads(1)
    facts = cpu_facts()
    why = int4_kernel_status()
    lines = [
        "# int4 weights on the CPU, one thread",
        "",
        f"`{command('bench_int4', argv)}`: "
        "`rows x in` float32 activations "
        "times an `in x out` weight, median µs per call over "
        f"{ROUNDS} rounds, candidates interleaved; ratio = float32 µs / candidate µs "
        "(above 1 is faster). Error: max |candidate - int4 torch| / max |output| "
        "(float32, fp16, int8 groups and bf16 onednn multiply other weights, so theirs "
        "is the quantization error; "
        "int4-q8's is its activations' rounding). int4-q8 vs int4: the int4 kernel's µs over "
        "int4-q8's, same run.",
        "",
        *[f"- {k}: {v}" for k, v in facts.items()],
        f"- C++ kernel: {'built' if why is None else why}",
        f"- CPU features: {cpu_features().describe()}",
        f"- kernel paths: {kernel_summary(['int4', 'int4-q8', 'int4-bf16', 'fp16'])}",
        "",
        "| product | rows | candidate | µs | vs float32 | int4-q8 vs int4 | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, out, inp, rows in PRODUCTS:
        results = measure(out, inp, rows)
        base = results["float32"][0]
        int4 = results.get("int4 kernel", (float("nan"), 0.0))[0]
        for name, (us, err) in results.items():
            ratio = "" if name == "float32" else f"{base / us:.2f}x"
            vs_int4 = f"{int4 / us:.2f}x" if name.startswith("int4-q8") else ""
            row = f"| {label} | {rows} | {name} | {us:.1f} | {ratio} | {vs_int4} | {err:.1e} |"
            print(row.replace("|", " ").strip())
            lines.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
