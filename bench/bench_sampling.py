"""The cost of sampling inside the captured decode step, as a fraction of the step.

For each model shape and batch size, in the same run and on the same batch
(every row holding ``context - 1`` cached tokens), the median step time of:

- ``plain+argmax``: the plain decode runner (logits out), then ``argmax``
  outside the graph, as the greedy engine did;
- ``sampled greedy``: the sampled runner (``create_decode_runner(...,
  sampling=True)``), every row temperature 0 (its tokens are checked equal to
  the argmax of the plain runner's logits);
- ``sampled top-p``: the same runner, every row temperature 0.8, top-p 0.9.
- ``penalties neutral``: the runner with penalties (``create_decode_runner(...,
  sampling=True, penalties=True)``), every row greedy with neutral penalties
  (its tokens are checked equal to that argmax too): what a server that may
  get penalties pays on a step where none asks for them;
- ``penalties on``: the same runner, every row with every penalty and a
  logit bias.

The sampling rows are built once per batch (the engine rebuilds them only when
the batch's requests change), so a replay pays the populate of the five
sampling buffers and the sampler inside the graph. The three variants are
timed round-robin (one call each per round), so drift on a shared machine
hits them alike. Ratios are sampled / plain.

On the CPU: the compiled CPU runner (inductor), one thread, the embedded
default model (vocab 256) and a ``mid`` shape with the 1.1B model's vocabulary
(32000: the sampler's sort spans it); the 1.1B shape itself takes seconds per
step there. On a GPU: the 1.1B shape in bfloat16, CUDA graphs, context 1024.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_sampling`` (writes
``bench/results/sampling-cpu.md`` and ``.json``; on a CUDA machine
``sampling-<device>.md``). Not collected as a test or a pytest benchmark.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from bench.bench_gpu_model import filled_batch
from bench.conftest import RESULTS_DIR, machine
from graphrunner import GraphRunner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.declare.inputs import StepInputs
from graphrunner.phases.sampled import with_sampling
from graphrunner.sampling import SamplingParams, penalty_tensors, sampling_tensors
from graphrunner.testing import torch_threads
from graphrunner_ref import create_decode_runner, default_model
from graphrunner_ref.model import ModelBundle, shape_1b_config
from graphrunner_ref.model.config import ModelConfig

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_sampling"
VARIANTS = (
    "plain+argmax",
    "sampled greedy",
    "sampled top-p",
    "penalties neutral",
    "penalties on",
)
TOP_P = SamplingParams(temperature=0.8, top_p=0.9)
#: The ``penalties on`` rows: every penalty and a few biased tokens, greedy.
PENALIZED = SamplingParams(
    repetition_penalty=1.2,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    logit_bias={1: 5.0, 2: -5.0, 3: 1.0},
)


def mid_config() -> ModelConfig:
    """4 layers, hidden 256, 8 query / 4 KV heads of 32, intermediate 688,
    the 1.1B shape's vocabulary (32000), context 1024."""
    return ModelConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=1024,
    )


#: Shape name -> its config (None: the embedded default model).
SHAPES: dict[str, Callable[[], ModelConfig] | None] = {
    "default": None,
    "mid": mid_config,
    "1.1b": shape_1b_config,
}


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of ``fn`` over ``n`` calls (device events on a GPU)."""

    def cpu(fn: Callable[[], object], n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    def cuda(fn: Callable[[], object], n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / n

    return cuda if device.type == "cuda" else cpu


def penalty_rows(
    params: Sequence[SamplingParams], seeds: Sequence[int], device: str
) -> dict[str, torch.Tensor]:
    """The sampling and penalty rows of ``params``, for a runner with penalties."""
    return sampling_tensors(params, seeds, device) | penalty_tensors(params, device)


def plain_tokens(runner: GraphRunner, batch: DecodeBatch) -> torch.Tensor:
    """One step of the plain runner, argmax outside the graph: tokens ``[bs]``."""
    logits = runner.replay(batch)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"plain runner returned {type(logits).__name__}; expected logits")
    return logits.argmax(-1)


def sampled_tokens(runner: GraphRunner, inputs: StepInputs) -> torch.Tensor:
    """One step of the sampled runner: its tokens ``[bs]``."""
    out = runner.replay(inputs)
    if not isinstance(out, dict):
        raise TypeError(f"sampled runner returned {type(out).__name__}; expected a dict")
    return out["tokens"]


def measure_shape(
    shape: str,
    sizes: Sequence[int],
    *,
    device: str,
    dtype: torch.dtype,
    context: int,
    rounds: int,
    per_round: int,
) -> list[dict[str, Any]]:
    """Median step times of every variant at every size for one shape."""
    config = SHAPES[shape]
    t0 = time.perf_counter()
    bundle: ModelBundle = default_model(
        max_requests=max(sizes),
        max_context_len=context,
        device=device,
        dtype=dtype,
        config=None if config is None else config(),
    )
    for buf in bundle.kv_cache.k_buffers + bundle.kv_cache.v_buffers:
        buf.normal_()
    kind = "cuda" if bundle.device.type == "cuda" else "cpu"
    plain = create_decode_runner(bundle, kind, capture_sizes=list(sizes))
    plain.capture()
    sampled = create_decode_runner(bundle, kind, capture_sizes=list(sizes), sampling=True)
    sampled.capture()
    penalized = create_decode_runner(
        bundle, kind, capture_sizes=list(sizes), sampling=True, penalties=True
    )
    penalized.capture()
    print(f"{shape}: built and captured in {time.perf_counter() - t0:.1f} s", flush=True)
    timer, rows = _timer(bundle.device), []
    for bs in sizes:
        batch = filled_batch(bundle, bs, context)
        seeds = list(range(bs))
        greedy = with_sampling(batch, sampling_tensors([SamplingParams()] * bs, seeds, device))
        top_p = with_sampling(batch, sampling_tensors([TOP_P] * bs, seeds, device))
        neutral = with_sampling(batch, penalty_rows([SamplingParams()] * bs, seeds, device))
        on = with_sampling(batch, penalty_rows([PENALIZED] * bs, seeds, device))
        calls: dict[str, Callable[[], object]] = {
            "plain+argmax": partial(plain_tokens, plain, batch),
            "sampled greedy": partial(sampled_tokens, sampled, greedy),
            "sampled top-p": partial(sampled_tokens, sampled, top_p),
            "penalties neutral": partial(sampled_tokens, penalized, neutral),
            "penalties on": partial(sampled_tokens, penalized, on),
        }
        with torch.no_grad():
            argmax = plain_tokens(plain, batch).clone()
            tokens = sampled_tokens(sampled, greedy).clone()
            unpenalized = sampled_tokens(penalized, neutral).clone()
            # Warm-up; "auto" calls per round: a round of the slowest variant
            # lasts ~20 ms (one call where a step takes longer).
            slowest = max(timer(fn, 1) for fn in calls.values())
            n = per_round or max(1, min(50, round(0.02 / slowest)))
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(rounds):
                for variant, fn in calls.items():
                    times[variant].append(timer(fn, n))
        medians = {v: statistics.median(t) for v, t in times.items()}
        base = medians["plain+argmax"]
        for variant in VARIANTS:
            row = {
                "shape": shape,
                "vocab": bundle.config.vocab_size,
                "bs": bs,
                "variant": variant,
                "median_ms": medians[variant] * 1e3,
                "ratio_vs_plain": medians[variant] / base,
                "rounds": rounds,
                "calls_per_round": n,
            }
            if variant == "sampled greedy":
                row["tokens_equal_argmax"] = bool(torch.equal(tokens, argmax))
            if variant == "penalties neutral":
                row["tokens_equal_argmax"] = bool(torch.equal(unpenalized, argmax))
            rows.append(row)
            print(_line(row), flush=True)
    return rows


COLUMNS = "| shape | vocab | bs | variant | median step (ms) | sampled / plain |"


def _line(r: dict[str, Any]) -> str:
    ratio = "" if r["variant"] == "plain+argmax" else f"{r['ratio_vs_plain']:.2f}x"
    return (
        f"| {r['shape']} | {r['vocab']} | {r['bs']} | {r['variant']} | "
        f"{r['median_ms']:.3f} | {ratio} |"
    )


def write(result: dict[str, Any], slug: str) -> str:
    out = RESULTS_DIR / f"sampling-{slug}.md"
    greedy = [r for r in result["rows"] if "tokens_equal_argmax" in r]
    lines = [
        "# in-graph sampling vs argmax outside the graph, one decode step",
        "",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- command: `{result['command']}`",
        f"- mechanism: {result['mechanism']}; dtype {result['dtype']}; torch threads "
        f"{result['threads']}; every row {result['context'] - 1} cached tokens",
        f"- medians of {result['rounds']} rounds per variant, variants round-robin, each round "
        "as many calls as make the slowest variant's ~20 ms (at least 1; per row in the "
        ".json); the sampling rows built once per batch",
        "- plain+argmax: the plain runner's logits, argmax outside the graph; sampled greedy: "
        "the sampled runner, temperature 0 (tokens equal to that argmax: "
        f"{all(r['tokens_equal_argmax'] for r in greedy)}); sampled top-p: temperature 0.8, "
        "top-p 0.9; penalties neutral: the runner with penalties "
        "(`create_decode_runner(..., penalties=True)`), every row greedy and neutral (tokens "
        "equal to the argmax too); penalties on: every row greedy with repetition 1.2, "
        "presence 0.5, frequency 0.5 and 3 biased tokens",
        "- shapes: default = the embedded model (2 layers, hidden 64, vocab 256); mid = 4 "
        "layers, hidden 256, intermediate 688, 8/4 heads of 32, vocab 32000; 1.1b = "
        "`shape_1b_config()` (22 layers, hidden 2048, vocab 32000)",
        "",
        COLUMNS,
        "|---|---|---|---|---|---|",
        *(_line(r) for r in result["rows"]),
    ]
    RESULTS_DIR.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return str(out)


def main(argv: Sequence[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1.1b" if cuda else "default,mid")
    parser.add_argument("--sizes", default="1,64", help="batch sizes (each captured exactly)")
    parser.add_argument("--context", type=int, default=1024 if cuda else 128)
    parser.add_argument("--rounds", type=int, default=21 if cuda else 11)
    parser.add_argument(
        "--per-round", type=int, default=0, help="calls per round (0: ~20 ms a round)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows: list[dict[str, Any]] = []
    print(COLUMNS)
    with torch_threads(args.threads):
        for shape in args.shapes.split(","):
            rows += measure_shape(
                shape,
                sizes,
                device=device,
                dtype=dtype,
                context=args.context,
                rounds=args.rounds,
                per_round=args.per_round,
            )
    info = machine()
    slug = re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-") if cuda else "cpu"
    result = {
        "machine": info,
        "command": CMD + (f" {' '.join(sys.argv[1:])}" if argv is None and sys.argv[1:] else ""),
        "mechanism": "cuda (CUDA graphs)" if cuda else "cpu (inductor-compiled program)",
        "dtype": str(dtype).removeprefix("torch."),
        "threads": args.threads,
        "context": args.context,
        "rounds": args.rounds,
        "per_round": args.per_round,
        "rows": rows,
    }
    print(f"results written to {write(result, slug)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
