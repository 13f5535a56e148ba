"""The Triton decode attention alone at the 1.1B shape (32 query / 4 KV heads
of 64, bf16), every row at ``--context`` tokens, beside the floor of reading
its K and V once at the device's copy bandwidth: a sweep of the split
launch's layouts (``per_head``, ``all_heads``), split counts and launch
settings, to pick the layout, ``choose_splits`` and the defaults. Prints a
table; without a GPU it says so and exits 0. Run from the repository root:
``.venv/bin/python -m bench.bench_decode_attention``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from bench.bench_gpu_model import copy_bandwidth
from graphrunner_ref.model.kernels.decode_attention import LAYOUTS, choose_splits, decode_attention

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


def paged_world(bs: int, context: int) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, req_to_token, req_pool_indices, seq_lens)`` on the GPU: ``bs``
    rows of ``context`` tokens at scattered slots of a bf16 pool laid out as the
    KV pool is, ``[slots, KV_HEADS, HEAD_DIM]`` contiguous."""
    slots = bs * context + 1
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    r2t = torch.zeros(bs + 1, context, dtype=torch.int32, device="cuda")
    r2t[1:] = (torch.randperm(slots - 1, device="cuda") + 1).view(bs, context).int()
    req = torch.arange(1, bs + 1, device="cuda")
    lens = torch.full((bs,), context, device="cuda")
    q = torch.randn(bs, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, k, v, r2t, req, lens


def variants(layouts: Sequence[str], blocks: Sequence[int | None]) -> list[tuple[Any, ...]]:
    """``(layout, block_n, splits, warps, stages)`` to time; ``block_n`` None is
    the kernel's default; the per-head layout takes its default block only."""
    return [
        (layout, block, *launch)
        for layout in layouts
        for block in (blocks if layout == "all_heads" else (None,))
        for launch in itertools.product((1, 2, 4, 8, 16), (4, 8), (2, 3))
    ]


def sweep(
    bs: int,
    context: int,
    bandwidth: float,
    iters: int,
    layouts: Sequence[str],
    blocks: Sequence[int | None],
) -> None:
    world = paged_world(bs, context)
    floor = 2 * bs * context * KV_HEADS * HEAD_DIM * 2 / bandwidth
    out = torch.empty_like(world[0])
    for layout, block, splits, warps, stages in variants(layouts, blocks):

        def call(
            lay: str = layout,
            b: int | None = block,
            s: int = splits,
            w: int = warps,
            st: int = stages,
        ) -> None:
            decode_attention(
                *world, scale=1 / math.sqrt(HEAD_DIM), num_splits=s, out=out, layout=lay,
                block_n=b, num_warps=w, num_stages=st,
            )  # fmt: skip

        seconds = graph_time(call, iters)
        # The all-heads grid has KV_HEADS times fewer programs per split.
        chosen = choose_splits(bs, KV_HEADS, context, layout=layout)
        mark = " (chosen splits)" if splits == chosen else ""
        print(
            f"| {bs} | {layout} | {block or 'default'} | {splits}{mark} | {warps} | {stages} | "
            f"{seconds * 1e6:.1f} | {floor * 1e6:.1f} | {100 * floor / seconds:.0f}% |",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,64", help="batch sizes")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help=f"split-launch layouts, of {LAYOUTS}"
    )
    parser.add_argument(
        "--blocks",
        default="default",
        help="keys per block for all_heads: 'default' and/or powers of two >= 16, e.g. 16,32",
    )
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    if bad := sorted(set(layouts) - set(LAYOUTS)):
        parser.error(f"--layouts: {bad} not in {LAYOUTS}")
    blocks = [None if b == "default" else int(b) for b in args.blocks.split(",")]
    if not torch.cuda.is_available():
        print("bench_decode_attention: no CUDA device here; nothing measured")
        return 0
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(
        "| bs | layout | block | splits | warps | stages | kernel (us) | KV floor (us) "
        "| % of floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for bs in (int(s) for s in args.sizes.split(",")):
        sweep(bs, args.context, bandwidth, args.iters, layouts, blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
