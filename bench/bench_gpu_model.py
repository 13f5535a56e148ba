"""One decode step of the 1.1B-shape model on a GPU, beside its bandwidth floor.

The embedded random "1.1B-shape" Llama (:func:`graphrunner_ref.model.shape_1b_config`)
in bfloat16, every row holding ``--context`` cached tokens, one step at batch
1, 8, 32 and 64 for:

- ``eager``: the eager forward with the torch attention (the reference);
- ``graph``: the CUDA runner over that forward;
- ``graph+triton``: the CUDA runner over the forward with the Triton attention;
- ``graph+compile+triton``: the CUDA runner over the inductor-compiled forward
  with the Triton attention (the reference model's default on CUDA);
- ``graph+compile+triton-all-heads``: the same with the kernel's
  ``"all_heads"`` split launch;
- ``graph+compile+triton+gemv``: ``graph+compile+triton`` whose steps of at
  most 16 rows run the Triton small-batch linears
  (:func:`~graphrunner_ref.model.llama.use_small_batch_linears`);
- ``graph+compile+triton+pdl`` and ``graph+compile+triton+gemv+pdl``: those
  two with our Triton kernels (attention, small-batch linears) launched
  programmatically (:mod:`graphrunner_ref.model.programmatic_launch`);
- ``graph+compile+triton+gemv+pdl-inductor``: inductor's kernels too, with
  inductor's own placement of the waits (``kernels.pdl.INDUCTOR_OPTIONS``).

The floor is the bytes a step must read (every weight once, the embedding
rows it looks up, every row's cached K and V) over the device's copy
bandwidth, measured here with a device-to-device copy; each variant is shown
as a percentage of that floor. Results go to ``bench/results/`` named by the
device. Without a GPU the script says so and exits 0. Run:
``.venv/bin/python bench/bench_gpu_model.py`` (``--sizes 1,64`` for fewer;
``--variants a,b`` for some; ``--autotune`` adds inductor's autotuned GEMMs,
slow to compile).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.conftest import RESULTS_DIR
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner_ref.engine.loop import create_decode_runner
from graphrunner_ref.model import ModelBundle, default_model, shape_1b_config
from graphrunner_ref.model.kernels.gemv import MAX_ROWS
from graphrunner_ref.model.kernels.pdl import INDUCTOR_OPTIONS
from graphrunner_ref.model.llama import use_small_batch_linears
from graphrunner_ref.model.programmatic_launch import use_programmatic_launch

#: The step table's columns; the last is the logits' largest difference from
#: the size's first variant that ran (named in the JSON), over their standard deviation.
COLUMNS = ("bs", "variant", "step (ms)", "floor (ms)", "% of floor", "max abs diff / std")
SIZES = [1, 8, 32, 64]
#: Variant -> (attention (``TorchPagedBackend.use``), CUDA runner options; None: eager).
VARIANTS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "eager": ("torch", None),
    "graph": ("torch", {}),
    "graph+triton": ("triton", {}),
    "graph+compile+triton": ("triton", {"compile": True}),
    # The kernel's other split launch (one program over every KV head of a chunk).
    "graph+compile+triton-all-heads": ("triton-all-heads", {"compile": True}),
    # The Triton small-batch linears (norm + q/k/v, o, norm + gate/up + SiLU,
    # down, LM head) for steps of at most MAX_ROWS rows, cuBLAS above.
    "graph+compile+triton+gemv": ("triton", {"compile": True}),
    # Programmatic dependent launch for our Triton kernels; then inductor's too.
    "graph+compile+triton+pdl": ("triton", {"compile": True}),
    "graph+compile+triton+gemv+pdl": ("triton", {"compile": True}),
    "graph+compile+triton+gemv+pdl-inductor": (
        "triton",
        {"compile": True, "inductor_options": INDUCTOR_OPTIONS},
    ),
}
#: Variants whose model runs the small-batch linears, and up to how many rows.
SMALL_BATCH_ROWS = {
    "graph+compile+triton+gemv": MAX_ROWS,
    "graph+compile+triton+gemv+pdl": MAX_ROWS,
    "graph+compile+triton+gemv+pdl-inductor": MAX_ROWS,
}
#: Variants whose model's Triton kernels launch programmatically.
PROGRAMMATIC = {
    "graph+compile+triton+pdl",
    "graph+compile+triton+gemv+pdl",
    "graph+compile+triton+gemv+pdl-inductor",
}
#: With ``--autotune``: inductor's GEMM templates autotuned against cuBLAS
#: (minutes of compilation per size; batch 1's projections are GEMVs).
AUTOTUNED: dict[str, tuple[str, dict[str, Any] | None]] = {
    "graph+autotune+triton": (
        "triton",
        {"compile": True, "compile_mode": "max-autotune-no-cudagraphs"},
    ),
}


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device copy bandwidth in bytes/s: bytes read plus bytes written by the
    fastest of ``repeats`` copies of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_time(lambda: dst.copy_(src), iters=1) for _ in range(repeats))
    return 2 * nbytes / best


def _time(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``fn``, timed on the device over ``iters`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def step_floors(bundle: ModelBundle, bs: int, context: int) -> dict[str, int]:
    """Bytes one decode step must read, by what reads them: ``projections``,
    every weight but the embedding table and the ``bs`` embedding rows;
    ``attention``, ``context`` tokens of K and V per row."""
    model = bundle.model
    embed = model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= embed.numel() * embed.element_size() if model.lm_head is not None else 0
    rows = bs * embed.shape[1] * embed.element_size()
    k = bundle.kv_cache.k_buffers[0]
    kv_per_token = 2 * len(bundle.kv_cache.k_buffers) * k[0].numel() * k.element_size()
    return {"projections": weights + rows, "attention": bs * context * kv_per_token}


def step_bytes(bundle: ModelBundle, bs: int, context: int) -> int:
    """Bytes one decode step must read (:func:`step_floors` together)."""
    return sum(step_floors(bundle, bs, context).values())


def filled_batch(bundle: ModelBundle, bs: int, context: int) -> DecodeBatch:
    """``bs`` requests of ``context - 1`` cached tokens (random K/V at scattered
    slots), prepared for the step that writes token ``context``."""
    bundle.req_pool.clear()
    bundle.kv_alloc.clear()
    reqs = bundle.req_pool.alloc(bs)
    r2t, device = bundle.req_pool.req_to_token, bundle.device
    for req in reqs:
        r2t[req, : context - 1] = torch.tensor(bundle.kv_alloc.alloc(context - 1), device=device)
    batch = DecodeBatch.from_requests(
        reqs,
        [context - 1] * bs,
        torch.randint(bundle.config.vocab_size, (bs,), device=device),
        device=device,
        max_context_len=bundle.max_context_len,
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return batch


def prepare(bundle: ModelBundle, variant: str, batch: DecodeBatch) -> Callable[[], torch.Tensor]:
    """The step of ``variant`` on ``batch``, ready to call: the eager forward,
    or a CUDA runner captured at exactly the batch's size, replaying it."""
    attention, options = {**VARIANTS, **AUTOTUNED}[variant]
    bundle.model.attn_backend.use(attention)
    use_small_batch_linears(bundle.model, SMALL_BATCH_ROWS.get(variant, 0))
    use_programmatic_launch(bundle.model, variant in PROGRAMMATIC)
    if options is None:

        def eager() -> torch.Tensor:
            with torch.no_grad():
                return bundle.model.forward_decode(batch)

        return eager
    bs = batch.req_pool_indices.shape[0]
    runner = create_decode_runner(bundle, "cuda", capture_sizes=[bs], **options)
    runner.capture()
    return lambda: runner.replay(batch)


def measure(
    bundle: ModelBundle, variant: str, batch: DecodeBatch, iters: int
) -> tuple[float, torch.Tensor]:
    """Seconds per step of ``variant`` on ``batch`` (captured at exactly its
    size), and the step's logits (a copy)."""
    step = prepare(bundle, variant, batch)
    logits = step().clone()  # and the warm-up
    return _time(step, iters), logits


def _difference(got: torch.Tensor, reference: torch.Tensor | None) -> float:
    """Largest |difference| over the reference's spread (0 for the reference)."""
    if reference is None:
        return 0.0
    return float((got.float() - reference.float()).abs().max() / reference.float().std())


def shape_1b_bundle(max_requests: int, context: int) -> ModelBundle:
    """The 1.1B-shape model in bfloat16 on the GPU, seeded, its KV pool random."""
    torch.manual_seed(0)
    bundle = default_model(
        max_requests=max_requests,
        max_context_len=context,
        device="cuda",
        dtype=torch.bfloat16,
        config=shape_1b_config(),
    )
    for buf in bundle.kv_cache.k_buffers + bundle.kv_cache.v_buffers:
        buf.normal_()
    return bundle


def runs_at(variant: str, bs: int) -> bool:
    """Whether ``variant`` is its own step at ``bs`` (past the small-batch rows
    it is its torch-path twin's)."""
    return bs <= SMALL_BATCH_ROWS.get(variant, bs)


def run(
    sizes: Sequence[int], context: int, iters: int, variants: Sequence[str] = tuple(VARIANTS)
) -> dict[str, object]:
    bundle = shape_1b_bundle(max(sizes), context)
    bandwidth = copy_bandwidth()
    device = torch.cuda.get_device_name()
    print(f"device: {device}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; context {context}")
    print(f"| {' | '.join(COLUMNS)} |")
    print("|---" * len(COLUMNS) + "|")
    rows: list[dict[str, object]] = []
    result: dict[str, object] = {
        "device": device,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "model": "1.1B-shape, bfloat16, random weights",
        "context": context,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "rows": rows,
    }
    for bs in sizes:
        batch = filled_batch(bundle, bs, context)
        floor = step_bytes(bundle, bs, context) / bandwidth
        reference: torch.Tensor | None = None  # the size's first variant that ran
        reference_variant = ""
        for variant in variants:
            if not runs_at(variant, bs):
                continue
            t0 = time.perf_counter()
            try:
                seconds, logits = measure(bundle, variant, batch, iters)
            except Exception as e:  # one variant failing leaves the others' figures
                rows.append({"bs": bs, "variant": variant, "error": f"{type(e).__name__}: {e}"})
                print(_line(rows[-1]), flush=True)
                continue
            finally:
                gc.collect()  # the variant's graphs and their pool go before the next
                torch.cuda.empty_cache()
            if reference is None:
                reference, reference_variant = logits, variant
            row = {
                "bs": bs,
                "variant": variant,
                "step_ms": seconds * 1e3,
                "floor_ms": floor * 1e3,
                "pct_of_floor": 100 * floor / seconds,
                "setup_s": time.perf_counter() - t0,
                # Against the size's first variant: a fast step that is wrong shows here.
                "max_diff_over_std": _difference(logits, reference),
                "reference_variant": reference_variant,
            }
            rows.append(row)
            print(_line(row), flush=True)
        write(result)  # after every size: a run cut short keeps what it measured
    return result


def _line(r: dict[str, Any]) -> str:
    """One row of the step table (a failed variant: its error)."""
    if "error" in r:
        return f"| {r['bs']} | {r['variant']} | failed: {' '.join(r['error'].split())[:200]} |"
    return (
        f"| {r['bs']} | {r['variant']} | {r['step_ms']:.3f} | {r['floor_ms']:.3f} | "
        f"{r['pct_of_floor']:.0f}% | {r.get('max_diff_over_std', 0.0):.3f} |"
    )


def write(result: dict[str, object]) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", str(result["device"]).lower()).strip("-")
    out = RESULTS_DIR / f"gpu-model-step-{slug}.md"
    lines = [
        f"# 1.1B-shape decode step ({result['device']})",
        "",
        *(f"- {k}: {result[k]}" for k in ("torch", "date", "model", "context")),
        f"- copy bandwidth: {float(result['copy_bandwidth_bytes_per_s']) / 1e12:.2f} TB/s",  # type: ignore[arg-type]
        "",
        f"| {' | '.join(COLUMNS)} |",
        "|---" * len(COLUMNS) + "|",
    ]
    lines += [_line(r) for r in result["rows"]]  # type: ignore[attr-defined]
    RESULTS_DIR.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="batch sizes")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per row + 1")
    parser.add_argument("--iters", type=int, default=50, help="timed steps per variant")
    parser.add_argument(
        "--autotune",
        action="store_true",
        help=f"also run {', '.join(AUTOTUNED)} (slow to compile)",
    )
    parser.add_argument(
        "--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)} (all)"
    )
    args = parser.parse_args(argv)
    variants = [*VARIANTS, *(AUTOTUNED if args.autotune else ())]
    if args.variants is not None:
        chosen = args.variants.split(",")
        unknown = [v for v in chosen if v not in {**VARIANTS, **AUTOTUNED}]
        if unknown:
            parser.error(f"--variants: unknown {unknown}: expected some of {variants}")
        variants = chosen
    if not torch.cuda.is_available():
        print("bench_gpu_model: no CUDA device here; nothing measured")
        return 0
    result = run([int(s) for s in args.sizes.split(",")], args.context, args.iters, variants)
    print(f"results written to {write(result)}")
    return 0


def bench_gpu_model_step() -> None:
    """pytest entry (``pytest bench/bench_gpu_model.py``): skips without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    main([])


if __name__ == "__main__":
    sys.exit(main())
