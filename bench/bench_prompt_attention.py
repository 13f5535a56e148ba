"""A prompt chunk's attention on the CPU: the C++ kernel against torch's fused
attention, the path it replaced.

At SmolLM2-135M's attention shape (9 query heads over 3 KV heads of 64), one
thread, a float16 cache by default, one request's chunk of ``n`` tokens over
``L`` slots scattered in the cache (token ``i`` reading slots ``0 .. L - n +
i``): a prefix-cache hit's 32 new tokens after 1,024 cached, whole prompts
of 256 to 4,096 tokens, and a 512-token chunk after 3,584. Each case times
the kernel (:func:`~graphrunner_ref.model.attention_cpu.cpp_prompt_attention`)
and its torch twin, the path the token batch ran before it and runs where
the kernel does not (:func:`~graphrunner_ref.model.attention_torch.torch_prompt_attention`:
the slots read, then ``scaled_dot_product_attention`` with ``enable_gqa``,
causal for a whole prompt and with the prefix's mask after one). Outputs are
checked equal within float32 rounding first; then interleaved rounds,
medians, the ratio, and GFLOP/s counting the causal half only.

``PYTHONPATH=. .venv/bin/python -m bench.bench_prompt_attention`` writes
``bench/results/prompt-attention-<cpu>.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from bench.bench_gemm_peak import cpu_slug
from bench.conftest import RESULTS_DIR, command, machine, write_results
from graphrunner_ref.model.attention_cpu import cpp_prompt_attention, cpp_prompt_runs
from graphrunner_ref.model.attention_torch import torch_prompt_attention
from graphrunner_ref.model.cpu_features import cpu_features

HEADS, KV_HEADS, DIM = 9, 3, 64
#: (label, n, L): the chunk's tokens and the slots it reads.
CASES = [
    ("prefix hit", 32, 1056),
    ("whole prompt", 256, 256),
    ("whole prompt", 1024, 1024),
    ("whole prompt", 4096, 4096),
    ("chunk after 3,584", 512, 4096),
]
CACHES = {"float32": torch.float32, "float16": torch.float16}


def _time(fn: Callable[[], object], into: list[float]) -> None:
    start = time.perf_counter()
    fn()
    into.append((time.perf_counter() - start) * 1e3)


def measure(n: int, length: int, cache: torch.dtype, rounds: int) -> dict[str, float]:
    """Median ms of the kernel and of the torch path for one case, after
    checking they agree."""
    gen = torch.Generator().manual_seed(n + length)
    slots_total = length + 64
    q = torch.randn(n, HEADS, DIM, generator=gen)
    k = torch.randn(slots_total, KV_HEADS, DIM, generator=gen).to(cache)
    v = torch.randn(slots_total, KV_HEADS, DIM, generator=gen).to(cache)
    slots = torch.randperm(slots_total - 1, generator=gen)[:length] + 1
    scale = DIM**-0.5

    def kernel() -> torch.Tensor:
        return cpp_prompt_attention(q, k, v, slots, scale)

    def reference() -> torch.Tensor:
        return torch_prompt_attention(q, k, v, slots, scale)

    torch.testing.assert_close(kernel(), reference(), atol=1e-5, rtol=1e-4)
    times: dict[str, list[float]] = {"kernel": [], "torch": []}
    for _ in range(rounds):
        _time(kernel, times["kernel"])
        _time(reference, times["torch"])
    return {name: statistics.median(ms) for name, ms in times.items()}


def flops(n: int, length: int) -> float:
    """Two products of the causal pairs only: token i of n reads L - n + i + 1 keys."""
    pairs = n * (length - n) + n * (n + 1) / 2
    return 4.0 * pairs * HEADS * DIM


def report(rows: list[dict[str, object]], argv: Sequence[str] | None) -> str:
    lines = ["# A prompt chunk's attention: the C++ kernel against torch's fused attention", ""]
    lines += [f"- {key}: {value}" for key, value in machine().items()]
    lines += [f"- features: {cpu_features().describe()}",
              f"- shape: {HEADS} query heads over {KV_HEADS} KV heads of {DIM} (SmolLM2-135M), "
              "slots scattered in the cache; one thread; medians of interleaved rounds",
              f"- command: `{command('bench_prompt_attention', argv)}`", "",
              "| case | n tokens | L slots | cache | torch ms | kernel ms | torch GFLOP/s "
              "| kernel GFLOP/s | torch / kernel |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['n']} | {row['length']} | {row['cache']} "
            f"| {row['torch_ms']:.3f} | {row['kernel_ms']:.3f} | {row['torch_gflops']:.1f} "
            f"| {row['kernel_gflops']:.1f} | **{row['ratio']:.2f}x** |"
        )
    lines += ["", "GFLOP/s count the causal pairs only (both products); the torch path's "
              "time includes its read of the slots (`read_kv`), as the kernel's includes "
              "its widening of them."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per case")
    parser.add_argument("--cache", choices=sorted(CACHES), nargs="+", default=["float16"],
                        help="KV cache dtypes")  # fmt: skip
    parser.add_argument("--max-len", type=int, default=4096, help="skip cases of more slots")
    parser.add_argument("--out", default=None, help="results name (default prompt-attention-<cpu>)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if args.max_len < 1:
        parser.error(f"--max-len {args.max_len}: expected at least 1")
    if not cpp_prompt_runs(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)):
        print("the C++ prompt attention does not run here (it needs AVX-512 and a build)")
        return 1
    torch.set_num_threads(1)
    rows: list[dict[str, object]] = []
    for cache in args.cache:
        for case, n, length in CASES:
            if length > args.max_len:
                continue
            ms = measure(n, length, CACHES[cache], args.rounds)
            work = flops(n, length)
            row = {"case": case, "n": n, "length": length, "cache": cache,
                   "torch_ms": ms["torch"], "kernel_ms": ms["kernel"],
                   "torch_gflops": work / ms["torch"] / 1e6,
                   "kernel_gflops": work / ms["kernel"] / 1e6,
                   "ratio": ms["torch"] / ms["kernel"]}  # fmt: skip
            print(f"{case} n={n} L={length} {cache}: torch {ms['torch']:.3f} ms, kernel "
                  f"{ms['kernel']:.3f} ms: {row['ratio']:.2f}x", flush=True)  # fmt: skip
            rows.append(row)
    name = args.out or f"prompt-attention-{cpu_slug(cpu_features())}"
    write_results(RESULTS_DIR, name, report(rows, argv), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
