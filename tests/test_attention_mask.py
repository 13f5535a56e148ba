"""Masked key columns contribute exactly zero: a non-finite value planted in
the padding sink (KV slot 0, which every masked column reads in the torch
attention) leaves every live row's logits finite and bit-equal to a clean run,
for the torch attention, the Triton kernel (interpreted on CPU) and the CPU's
live-width attention."""

from __future__ import annotations

import pytest
import torch

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner_ref.model import ModelBundle, default_model

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [42]]
#: The Triton kernel runs on the GPU where there is one, else interpreted (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _live_batch(bundle: ModelBundle) -> DecodeBatch:
    reqs, lens = [], []
    for prompt in PROMPTS:
        req = bundle.req_pool.alloc(1)[0]
        slots = torch.tensor(bundle.kv_alloc.alloc(len(prompt)), device=DEVICE)
        bundle.model.forward_extend(req, torch.tensor(prompt, device=DEVICE), slots)
        reqs.append(req)
        lens.append(len(prompt))
    batch = DecodeBatch.from_requests(
        reqs, lens, torch.tensor([5, 6, 7]), device=DEVICE, max_context_len=bundle.max_context_len
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return batch


KERNELS = ["torch", "triton"] + ([] if DEVICE == "cuda" else ["live"])


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_sink_slot_leaves_live_rows_alone(kernel: str, poison: float) -> None:
    bundle = default_model(max_requests=4, max_context_len=64, device=DEVICE)
    bundle.model.attn_backend.kernel = kernel
    batch = _live_batch(bundle)  # live rows only: nothing rewrites slot 0 during the step
    with torch.no_grad():
        clean = bundle.model.forward_decode(batch).clone()
        for buf in bundle.kv_cache.k_buffers + bundle.kv_cache.v_buffers:
            buf[0] = poison
        poisoned = bundle.model.forward_decode(batch)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, clean)
