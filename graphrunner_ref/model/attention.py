"""Paged attention in plain torch, with static shapes so it can be graph-captured.

Every request's tokens live at scattered KV slots listed in its row of
``req_to_token``. Decode gathers that whole row (``max_context_len`` wide, the
same width for every batch) and masks the columns at or past ``seq_lens``
(which read KV slot 0 instead of the row's stale entries, and contribute
exactly zero: their values are zeroed, so a non-finite value in the sink slot 0
never reaches a live row): no shape depends on the data, nothing reads back to
the host, so one capture per batch size serves every step. Padded rows
(``req_pool_indices`` 0, ``seq_lens`` 1) read row 0 of ``req_to_token`` (all
zeros), so they attend to KV slot 0 only, the sink their own writes land in.

With ``kernel="triton"`` the decode reads go through the Triton split-KV
kernel instead (:mod:`graphrunner_ref.model.attention_op`), which reads only each
row's live tokens; with ``kernel="live"`` (the CPU's default from 512 columns up) through an op
that gathers only the columns up to the batch's longest live row
(:mod:`graphrunner_ref.model.attention_live`). This full-width torch attention
stays the reference both must equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner_ref.model.attention_cpu import (
    cpp_q8_runs,
    cpp_rope_store,
    cpp_rope_store_q8,
    cpp_rope_store_runs,
)
from graphrunner_ref.model.attention_meta import AttnMetadata, KVStore, attend, kv_scales
from graphrunner_ref.model.attention_tokens import prompt_attention, token_batch_attention
from graphrunner_ref.model.attention_torch import Scales
from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.fused import register_stack
from graphrunner_ref.model.layers import RotaryEmbedding

__all__ = ["PagedAttention"]


class PagedAttention(nn.Module):
    """Llama self-attention over a paged KV cache (q/k/v/o projections, with
    biases where ``config.attention_bias``).

    ``forward(x [n, hidden], positions [n], out_loc [n], kv, meta, rotary)``
    writes the new tokens' K/V for layer ``layer_id`` at ``out_loc`` *before*
    reading, so a token attends to itself, then returns ``[n, hidden]``.
    The q/k/v projections run as one product over ``qkv_weight``, of which
    their weights are views (:func:`~graphrunner_ref.model.fused.stack_weights`),
    or, once :meth:`quantize` ran, as ``qkv_proj`` (a compact linear).
    """

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None

    def __init__(
        self, config: ModelConfig, layer_id: int, *, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        #: The stacked q/k/v projection once quantized (None: ``qkv_weight``).
        self.qkv_proj: nn.Module | None = None
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)
        #: Calls of this many query rows or more attend in bfloat16, float32
        #: in and out (``--prefill-bf16``: a prompt chunk's attention on the
        #: CPU's bfloat16 units, as its projections); None: in ``q``'s dtype.
        self.prompt_bf16_rows: int | None = None
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=bias, dtype=dtype)
        heads_width = c.num_heads * c.head_dim
        self.o_proj: nn.Module = nn.Linear(heads_width, c.hidden_size, bias=bias, dtype=dtype)
        self._stack_qkv()

    def _stack_qkv(self) -> None:
        register_stack(self, "qkv", [self.q_proj, self.k_proj, self.v_proj])

    def _apply(self, fn: Any, recurse: bool = True) -> PagedAttention:
        # Moving or casting the module gives each parameter fresh storage: restack.
        super()._apply(fn, recurse)
        if self.qkv_proj is None:
            self._stack_qkv()
        return self

    def quantize(
        self,
        make: Callable[[torch.Tensor], nn.Module],
        make_qkv: Callable[[torch.Tensor], nn.Module] | None = None,
    ) -> None:
        """Replace the stacked q/k/v and the output projections by compact
        linears of their weights: ``make_qkv(weight)`` (default ``make``) and
        ``make(weight)``; the float weights are dropped."""
        self.qkv_proj = (make if make_qkv is None else make_qkv)(self.qkv_weight)
        self.o_proj = make(cast(torch.Tensor, self.o_proj.weight))
        del self.q_proj, self.k_proj, self.v_proj, self.qkv_weight

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        kv: KVStore,
        meta: AttnMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        qkv = (
            F.linear(x, self.qkv_weight, self.qkv_bias)
            if self.qkv_proj is None
            else self.qkv_proj(x)
        )
        return self.o_proj(self.attend_qkv(qkv, positions, out_loc, kv, meta, rotary))

    def attend_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        kv: KVStore,
        meta: AttnMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """:meth:`forward` from the stacked projection ``qkv [n, (H + 2 H_kv) D]``
        to the heads' outputs ``[n, H D]``, before ``o_proj``. On the CPU in
        float32 the rotary and the KV write are one C++ call
        (:func:`~graphrunner_ref.model.attention_cpu.cpp_rope_store`, the same
        values bit for bit; into an int8 cache, its ``_q8`` twin, which
        quantizes as ``set_kv`` does)."""
        k_buf, v_buf = kv.get_kv(self.layer_id)
        scales = kv_scales(kv, self.layer_id)
        if rotary.table_rotation and scales is not None and cpp_q8_runs(qkv, k_buf):
            q = cpp_rope_store_q8(
                qkv, positions, out_loc, rotary.cos, rotary.sin, (k_buf, v_buf, *scales),
                self.num_heads,
            )  # fmt: skip
            return self.attend_rotated(q, kv, meta)
        if rotary.table_rotation and cpp_rope_store_runs(qkv, k_buf):
            q = cpp_rope_store(
                qkv, positions, out_loc, rotary.cos, rotary.sin, k_buf, v_buf, self.num_heads
            )
            return self.attend_rotated(q, kv, meta)
        n, kv_width = qkv.shape[0], self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        kv.set_kv(self.layer_id, out_loc, k, v)
        return self.attend_rotated(q, kv, meta)

    def attend_rotated(self, q: torch.Tensor, kv: KVStore, meta: AttnMetadata) -> torch.Tensor:
        """The attention of rotated queries ``q [n, H D]`` (or ``[n, H, D]``) whose
        step's K/V are in ``kv`` already: the heads' outputs ``[n, H D]``, in
        ``q``'s dtype (computed in bfloat16 for a prompt chunk of at least
        :attr:`prompt_bf16_rows` rows)."""
        rows = self.prompt_bf16_rows
        if rows is None or meta.decode or q.shape[0] < rows or q.dtype != torch.float32:
            return self._attend(q, kv, meta)
        return self._attend(q.to(torch.bfloat16), kv, meta).to(q.dtype)

    def _attend(self, q: torch.Tensor, kv: KVStore, meta: AttnMetadata) -> torch.Tensor:
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k_buf, v_buf = kv.get_kv(self.layer_id)
        scales = kv_scales(kv, self.layer_id)  # an int8 cache's; None for a float one
        if meta.tokens is not None:  # a token batch: each request's own range
            return token_batch_attention(q, k_buf, v_buf, meta.tokens, self.scale, scales)
        # A prompt takes torch's fused attention, whose softmax is float32 for
        # float32 and half inputs; a float64 model keeps the float32 softmax of
        # transformers' eager attention (and of decode), which it would widen.
        fused = q.dtype != torch.float64 and meta.paged is None and meta.live is None
        if fused and not meta.decode:
            return self._prompt(q, k_buf, v_buf, meta, scales)
        out = attend(self._rows(q, meta.slots.shape[0]), k_buf, v_buf, meta, self.scale, scales)
        return self._unrows(out, n)

    def _prompt(
        self,
        q: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        meta: AttnMetadata,
        scales: Scales | None,
    ) -> torch.Tensor:
        """A prompt's attention, ``q [n, H, D]`` over its row's slots (its
        tokens the last, at consecutive positions): the C++ prompt attention
        where it runs, else its torch twin (:func:`prompt_attention`).
        Returns ``[n, H D]``."""
        attend = prompt_attention(q, k_buf, scales)
        return attend(q, k_buf, v_buf, meta.slots[0], self.scale, scales)

    def _rows(self, q: torch.Tensor, b: int) -> torch.Tensor:
        """``[n, H, D]`` to ``[b, H_kv, R, D]``: in decode (b == n) the rows of a KV
        head are its group's query heads; in extend (b == 1) they are every
        (token, group head) pair of the prompt, all reading one key row."""
        n = q.shape[0]
        q = q.view(n, self.num_kv_heads, -1, self.head_dim)
        if b == n:
            return q
        return q.transpose(0, 1).reshape(1, self.num_kv_heads, -1, self.head_dim)

    def _unrows(self, out: torch.Tensor, n: int) -> torch.Tensor:
        if out.shape[0] == n:
            return out.reshape(n, -1)
        out = out.view(self.num_kv_heads, n, -1, self.head_dim)
        return out.transpose(0, 1).reshape(n, -1)
