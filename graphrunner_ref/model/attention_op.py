"""The Triton decode attention as an opaque ``torch.library`` op.

``torch.compile`` does not trace into the op: inductor fuses everything around
it (norms, rotary, projections' epilogues) and calls it as one extern kernel,
so the CUDA runner's compiled forward keeps the Triton kernel and captures it
in its graphs. The fake implementation gives the output's shape and dtype
without running anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphrunner_ref.model.kernels.decode_attention import DecodeScratch, decode_attention

__all__ = ["PagedRows", "paged_attention", "paged_decode_attention"]


@dataclass(frozen=True, slots=True)
class PagedRows:
    """What the Triton kernel reads instead of gathered slots and a mask.

    req_to_token: int32 ``[num_reqs + 1, max_context_len]``.
    req_pool_indices, seq_lens: int64 ``[B]``; row ``b`` reads the KV slots
        ``req_to_token[req_pool_indices[b], :seq_lens[b]]``.
    num_splits: chunks per row, fixed by the batch size (static in a graph).
    layout: the kernel's split launch, one of
        :data:`~graphrunner_ref.model.kernels.decode_attention.LAYOUTS`.
    scratch: the chunks' partial results, allocated once by the backend; None
        (or too small, e.g. for more token rows than requests) and each call
        allocates its own (inside a graph: once, from the graph's pool).
    pdl: launch the kernels programmatically
        (:mod:`~graphrunner_ref.model.kernels.pdl`).
    """

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    num_splits: int
    scratch: DecodeScratch | None = None
    layout: str = "per_head"
    pdl: bool = False


# The scratch is declared mutated: inductor then passes the backend's buffers
# straight in (no copy) and keeps the op's order against other users of them.
@torch.library.custom_op(
    "graphrunner::paged_decode_attention", mutates_args=("partial_out", "partial_lse")
)
def paged_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    scale: float,
    num_splits: int,
    layout: str = "per_head",
    pdl: bool = False,
) -> torch.Tensor:
    """:func:`~graphrunner_ref.model.kernels.decode_attention.decode_attention` as an op:
    q ``[bs, heads, head_dim]`` to a new contiguous ``[bs, heads, head_dim]``,
    using the scratch ``partial_out`` / ``partial_lse`` where it fits."""
    out = q.new_empty(q.shape)
    return decode_attention(
        q.contiguous(),
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        seq_lens,
        scale=scale,
        num_splits=num_splits,
        out=out,
        scratch=DecodeScratch(partial_out, partial_lse),
        layout=layout,
        pdl=pdl,
    )


@paged_decode_attention.register_fake
def _fake(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    scale: float,
    num_splits: int,
    layout: str = "per_head",
    pdl: bool = False,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def paged_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: PagedRows, scale: float
) -> torch.Tensor:
    """Decode attention of ``q [B, H_kv, R, D]`` (``R`` = the group's query heads)
    through the op; returns ``[B, H_kv, R, D]``."""
    b, kv_heads, group, head_dim = q.shape
    scratch = rows.scratch
    if scratch is None:
        empty = q.new_empty(0, 1, 1, 1, dtype=torch.float32)
        scratch = DecodeScratch(empty, empty[..., 0])
    out = paged_decode_attention(
        q.reshape(b, kv_heads * group, head_dim),
        k_buf,
        v_buf,
        rows.req_to_token,
        rows.req_pool_indices,
        rows.seq_lens,
        scratch.partial_out,
        scratch.partial_lse,
        scale,
        rows.num_splits,
        rows.layout,
        rows.pdl,
    )
    return out.view(b, kv_heads, group, head_dim)
