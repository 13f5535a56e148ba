"""Where the 1.1B-shape step's device time goes: each kernel class against its floor.

For each batch size and variant of :mod:`bench.bench_gpu_model` (captured at
exactly its size, every row holding ``--context`` cached tokens), the torch
profiler records ``--rounds`` replays; each kernel's device time is summed
into a class by its name (:func:`kernel_class`):

- ``projections``: the GEMMs and GEMVs (cuBLAS, CUTLASS, nvjet) and the
  Triton small-batch linears; floor: every weight byte once (the embedding
  table's ``bs`` looked-up rows only) over the copy bandwidth;
- ``attention``: the Triton split and merge kernels (or torch's gather and
  softmax on the ``torch`` attention, which fall under ``elementwise``);
  floor: every row's cached K and V once;
- ``elementwise``: inductor's fused kernels (norms, rotary, KV writes,
  residual adds, SiLU) and torch's own pointwise kernels; ``copies``;
  ``collectives``; ``other``: no floor of their own.

A class's percentage of its floor is floor / time; the step's is the whole
floor over the whole step. Results: ``bench/results/gpu-model-profile-<device>.md``
(and ``.json``), beside the step table. Run on a GPU:
``PYTHONPATH=. python -m bench.bench_gpu_profile`` (``bash bench/gpu_steps.sh
profile``). Without one it says so and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from bench.bench_gpu_model import (
    RESULTS_DIR,
    copy_bandwidth,
    filled_batch,
    prepare,
    runs_at,
    shape_1b_bundle,
    step_floors,
)

CLASSES = ("projections", "attention", "elementwise", "copies", "collectives", "other")
#: Name fragments (lower case) of each class, tried in this order.
_FRAGMENTS = (
    ("attention", ("_split_kernel", "_split_all_heads_kernel", "_merge_kernel", "flash")),
    ("projections", ("_gemv_kernel", "gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk")),
    ("collectives", ("nccl",)),
    ("copies", ("memcpy", "memset")),
    ("elementwise", ("triton_", "elementwise", "reduce_kernel", "vectorized", "index")),
)
DEFAULT_VARIANTS = ("graph+compile+triton", "graph+compile+triton+gemv+pdl")


def kernel_class(name: str) -> str:
    """The class (one of :data:`CLASSES`) of a device kernel named ``name``."""
    low = name.lower()
    for cls, fragments in _FRAGMENTS:
        if any(f in low for f in fragments):
            return cls
    return "other"


def class_times(kernels: Iterable[tuple[str, float]], steps: int) -> dict[str, float]:
    """Microseconds per step of each class, from ``(kernel name, total µs)`` over ``steps``."""
    times = dict.fromkeys(CLASSES, 0.0)
    for name, us in kernels:
        times[kernel_class(name)] += us / steps
    return times


def class_rows(times: Mapping[str, float], floors: Mapping[str, float]) -> list[dict[str, Any]]:
    """One row per class with time: µs per step, share of the step, floor µs
    and percentage of the floor (None where the class has no floor); then the
    whole step against the whole floor."""
    step = sum(times.values())
    rows = []
    for cls in CLASSES:
        if times[cls] <= 0:
            continue
        floor = floors.get(cls)
        rows.append(
            {
                "class": cls,
                "us": times[cls],
                "share": times[cls] / step,
                "floor_us": floor,
                "pct_of_floor": None if floor is None else 100 * floor / times[cls],
            }
        )
    whole = sum(floors.values())
    rows.append(
        {"class": "step", "us": step, "share": 1.0, "floor_us": whole,
         "pct_of_floor": 100 * whole / step if step else None}
    )  # fmt: skip
    return rows


def _line(bs: int, variant: str, r: Mapping[str, Any]) -> str:
    floor = "-" if r["floor_us"] is None else f"{r['floor_us']:.1f}"
    pct = "-" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.0f}%"
    return (
        f"| {bs} | {variant} | {r['class']} | {r['us']:.1f} | {100 * r['share']:.0f}% | "
        f"{floor} | {pct} |"
    )


def _kernel_totals(prof: torch.profiler.profile) -> list[tuple[str, float]]:
    """(kernel name, device µs summed over the profile) of every device kernel."""
    out = []
    for avg in prof.key_averages():
        us = getattr(avg, "self_device_time_total", None)
        if us is None:  # older names
            us = getattr(avg, "self_cuda_time_total", 0.0)
        if us and avg.key:
            out.append((avg.key, float(us)))
    return out


def profile_step(step: Any, rounds: int) -> list[tuple[str, float]]:
    """Kernel totals of ``rounds`` calls of ``step`` (after one warm call)."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(rounds):
            step()
        torch.cuda.synchronize()
    return _kernel_totals(prof)


def run(sizes: Sequence[int], variants: Sequence[str], context: int, rounds: int) -> dict[str, Any]:
    bundle = shape_1b_bundle(max(sizes), context)
    bandwidth = copy_bandwidth()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "context": context,
        "rounds": rounds,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": [],
    }
    for bs in sizes:
        batch = filled_batch(bundle, bs, context)
        floors = {k: v / bandwidth * 1e6 for k, v in step_floors(bundle, bs, context).items()}
        for variant in variants:
            if not runs_at(variant, bs):
                continue
            step = prepare(bundle, variant, batch)
            times = class_times(profile_step(step, rounds), rounds)
            for row in class_rows(times, floors):
                result["rows"].append({"bs": bs, "variant": variant, **row})
                print(_line(bs, variant, row), flush=True)
            del step
            torch.cuda.empty_cache()
    return result


def write(result: Mapping[str, Any]) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", str(result["device"]).lower()).strip("-")
    out = RESULTS_DIR / f"gpu-model-profile-{slug}.md"
    lines = [
        f"# Where the 1.1B-shape step's device time goes ({result['device']})",
        "",
        f"torch {result['torch']}, {result['date']}, bfloat16, context {result['context']}, "
        f"copy bandwidth {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; the torch "
        f"profiler over {result['rounds']} replays, kernels summed by class "
        "(`bench/bench_gpu_profile.py`: projections' floor every weight once, "
        "attention's every cached K and V once). Command: "
        "`PYTHONPATH=. python -m bench.bench_gpu_profile`.",
        "",
        "| bs | variant | class | µs / step | share | floor (µs) | % of floor |",
        "|---|---|---|---|---|---|---|",
        *(_line(r["bs"], r["variant"], r) for r in result["rows"]),
    ]
    RESULTS_DIR.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return str(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,64", help="batch sizes")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=10, help="profiled replays per variant")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu_profile: no CUDA device; nothing measured (run it on a GPU)")
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    result = run(sizes, args.variants.split(","), args.context, args.rounds)
    print(f"results written to {write(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
