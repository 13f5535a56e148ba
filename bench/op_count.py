"""Op calls per decode step: the aten operators one eager decode step of the
embedded model dispatches (float32, and with each ``--quantize`` mode), and
the calls its CPU runner's compiled program makes (extern kernels: matrix
products and the compact linears; inductor's fused C++ loops are one call
each). Fewer calls is fewer launches and less interpreter time at batch 1.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.op_count`` (prints a table).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.bench_gpu_model import filled_batch
from graphrunner_ref.model import default_model
from graphrunner_ref.model.quantize import quantize_model


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count(mode: str | None) -> tuple[int, int]:
    """(every op dispatched, the weight products among them: mm / addmm and the
    compact linears, attention's bmm excluded) of one decode step at batch 1."""
    bundle = default_model(max_requests=1, max_context_len=64)
    if mode is not None:
        quantize_model(bundle.model, mode)
    batch = filled_batch(bundle, 1, 16)
    counter = _Count()
    with torch.no_grad(), counter:
        bundle.model.forward_decode(batch)
    products = sum(
        n
        for op, n in counter.ops.items()
        if op in {"aten.mm", "aten.addmm", "aten._weight_int8pack_mm"}
        or op.startswith("graphrunner")  # the compact linears' own ops
    )
    return sum(counter.ops.values()), products


def main() -> int:
    torch.set_num_threads(1)
    print("| weights | aten ops per step | products per step |")
    print("|---|---|---|")
    for mode in (None, "fp16", "int8", "int4"):
        total, products = count(mode)
        print(f"| {mode or 'float32'} | {total} | {products} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
