"""A token batch's attention, run per request from a layout planned on the host.

A token batch (:mod:`graphrunner.phases.token_batch`) holds any mix of
prompt chunks and decode rows: request ``i`` owns the next ``extend_lens[i]``
tokens and reads ``req_to_token[req_pool_indices[i], :seq_lens[i]]``, its
tokens causal by position. Each request is one call of the C++ prompt
attention where it runs (:func:`~graphrunner_ref.model.attention_cpu.cpp_prompt_attention`:
float32 on AVX-512, bfloat16 on AMX-BF16),
else of torch's fused attention (the prompt path of
:class:`~graphrunner_ref.model.attention.PagedAttention` either way),
its ranges read from the step's host buffers (``extend_lens_cpu``,
``seq_lens_cpu``): no device read, and no work for padded requests (they own
no token; padded tokens' rows stay zero).

The loop is an opaque op (:func:`token_batch_attention`), so a compiled
token-batch step keeps one program with a symbolic token axis and calls the
op between its pieces. Where the step must be one device graph (CUDA), the
backend runs the batch as decode rows instead, one per token, reading the
layout from device tensors (``TorchPagedBackend.token_batch_metadata``).
Over an int8 cache a twin op reads each request's KV dequantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphrunner_ref.model.attention_cpu import cpp_prompt_attention, cpp_prompt_runs
from graphrunner_ref.model.attention_torch import Scales, torch_prompt_attention

__all__ = ["TokenLayout", "prompt_attention", "token_batch_attention"]

#: One request's prompt chunk ``q [n, H, D]`` over its ``slots [L]``:
#: ``(q, k_buf, v_buf, slots, scale, scales) -> [n, H D]``.
PromptAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, Scales | None], torch.Tensor
]


def prompt_attention(
    q: torch.Tensor, k_buf: torch.Tensor, scales: Scales | None
) -> PromptAttention:
    """The attention a prompt chunk of queries like ``q`` over ``k_buf`` takes:
    the C++ kernel where it runs (:func:`cpp_prompt_runs`), else its torch
    twin (:func:`torch_prompt_attention`); the same for every request of a step."""
    return cpp_prompt_attention if cpp_prompt_runs(q, k_buf, scales) else torch_prompt_attention


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """Where each request of a token batch reads.

    req_to_token: int32 ``[rows, context]``.
    req_pool_indices: int64 ``[R]``, each request's row (padded: 0).
    seq_lens_cpu, extend_lens_cpu: host int64 ``[R]``, each request's length
        after the step and its tokens in the step (padded: the fill, 0).
    """

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_lens_cpu: torch.Tensor


@torch.library.custom_op("graphrunner_ref::token_batch_attention", mutates_args=())
def _attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    extend_lens_cpu: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    layout = TokenLayout(req_to_token, req_pool_indices, seq_lens_cpu, extend_lens_cpu)
    return _per_request(q, k_buf, v_buf, layout, scale, None)


@torch.library.custom_op("graphrunner_ref::token_batch_attention_q8", mutates_args=())
def _attention_q8(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    extend_lens_cpu: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    layout = TokenLayout(req_to_token, req_pool_indices, seq_lens_cpu, extend_lens_cpu)
    return _per_request(q, k_buf, v_buf, layout, scale, (k_scale, v_scale))


def _per_request(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    layout: TokenLayout,
    scale: float,
    scales: Scales | None,
) -> torch.Tensor:
    req_to_token, req_pool_indices = layout.req_to_token, layout.req_pool_indices
    attend = prompt_attention(q, k_buf, scales)  # one choice for every request
    tokens, heads, dim = q.shape
    rows = req_pool_indices.tolist() if req_pool_indices.device.type == "cpu" else None
    spans = [  # (request, its tokens, its length), padded requests (no token) left out
        (i, n, length)
        for i, (n, length) in enumerate(
            zip(layout.extend_lens_cpu.tolist(), layout.seq_lens_cpu.tolist(), strict=True)
        )
        if n > 0
    ]

    def slots(i: int, length: int) -> torch.Tensor:
        row = rows[i] if rows is not None else req_pool_indices[i]
        return req_to_token[row, :length].long()

    if len(spans) == 1 and spans[0][1] == tokens:  # one request owns every token (a prompt)
        i, _, length = spans[0]
        return attend(q, k_buf, v_buf, slots(i, length), scale, scales)
    out = q.new_empty(tokens, heads * dim)
    start = 0
    for i, n, length in spans:
        out[start : start + n] = attend(
            q[start : start + n], k_buf, v_buf, slots(i, length), scale, scales
        )
        start += n
    out[start:] = 0  # padded tokens
    return out


@_attention.register_fake
def _(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    extend_lens_cpu: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@_attention_q8.register_fake
def _(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    extend_lens_cpu: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def token_batch_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    layout: TokenLayout,
    scale: float,
    scales: Scales | None = None,
) -> torch.Tensor:
    """Rotated queries ``q [T, H, D]`` of a token batch over its requests' KV
    (the step's K/V already written; an int8 cache with its ``scales``): the
    heads' outputs ``[T, H D]``, zero on padded tokens."""
    where = (
        layout.req_to_token,
        layout.req_pool_indices,
        layout.seq_lens_cpu,
        layout.extend_lens_cpu,
        scale,
    )
    if scales is not None:
        return _attention_q8(q, k_buf, v_buf, *scales, *where)
    return _attention(q, k_buf, v_buf, *where)
