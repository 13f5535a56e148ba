"""The Triton decode attention alone at the 1.1B shape (32 query / 4 KV heads
of 64, bf16), every row at ``--context`` tokens, beside the floor of reading
its K and V once at the device's copy bandwidth: a sweep of split counts and
launch settings, to pick ``choose_splits`` and the defaults. Prints a table;
without a GPU it says so and exits 0. Run from the repository root:
``.venv/bin/python -m bench.bench_decode_attention``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Sequence

import torch

from bench.bench_gpu_model import copy_bandwidth
from graphrunner.kernels.decode_attention import choose_splits, decode_attention

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 64


def graph_time(fn: Callable[[], None], iters: int, reps: int = 20) -> float:
    """Device seconds per call of ``fn``: ``reps`` calls captured in one CUDA
    graph, replayed ``iters`` times between CUDA events, so the kernel is timed
    rather than Triton's Python launch path (tens of us, more than the kernel)."""
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (iters * reps)


def sweep(bs: int, context: int, bandwidth: float, iters: int) -> None:
    slots = bs * context + 1
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r2t = torch.zeros(bs + 1, context, dtype=torch.int32, device="cuda")
    r2t[1:] = (torch.randperm(slots - 1, device="cuda") + 1).view(bs, context).int()
    req = torch.arange(1, bs + 1, device="cuda")
    lens = torch.full((bs,), context, device="cuda")
    q = torch.randn(bs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    floor = 2 * bs * context * KV_HEADS * HEAD_DIM * 2 / bandwidth
    chosen = choose_splits(bs, KV_HEADS, context)
    out = torch.empty_like(q)
    for splits, warps, stages in itertools.product((1, 2, 4, 8, 16), (4, 8), (2, 3)):

        def call(s: int = splits, w: int = warps, st: int = stages) -> None:
            decode_attention(
                q, k, v, r2t, req, lens, scale=1 / math.sqrt(HEAD_DIM), num_splits=s,
                out=out, num_warps=w, num_stages=st,
            )  # fmt: skip

        seconds = graph_time(call, iters)
        mark = " (chosen splits)" if splits == chosen else ""
        print(
            f"| {bs} | {splits}{mark} | {warps} | {stages} | {seconds * 1e6:.1f} | "
            f"{floor * 1e6:.1f} | {100 * floor / seconds:.0f}% |",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,64", help="batch sizes")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_attention: no CUDA device here; nothing measured")
        return 0
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| bs | splits | warps | stages | kernel (us) | KV floor (us) | % of floor |")
    print("|---|---|---|---|---|---|---|")
    for bs in (int(s) for s in args.sizes.split(",")):
        sweep(bs, args.context, bandwidth, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
