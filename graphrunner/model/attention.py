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
kernel instead (:mod:`graphrunner.model.attention_op`), which reads only each
row's live tokens; this torch attention stays the reference it must equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.core.input_check import host_range
from graphrunner.declare.buffers import BufferView
from graphrunner.declare.inputs import StepInputs
from graphrunner.model.attention_op import PagedRows, paged_attention
from graphrunner.model.config import ModelConfig
from graphrunner.model.fused import stack_weights
from graphrunner.model.kernels.decode_attention import LAYOUTS, DecodeScratch, choose_splits
from graphrunner.model.layers import RotaryEmbedding

#: The decode attentions a :class:`TorchPagedBackend` can run.
ATTENTION_KERNELS = ("torch", "triton")
#: Named decode attentions (``--attention``): name -> (kernel, Triton layout).
ATTENTIONS = {
    "torch": ("torch", "per_head"),
    "triton": ("triton", "per_head"),
    "triton-all-heads": ("triton", "all_heads"),
}


class KVStore(Protocol):
    """What attention needs of :class:`graphrunner.pools.KVCache`."""

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class AttnMetadata:
    """Which KV slots each query reads, shared by all layers of one forward.

    slots: int64 ``[B, T]``, KV slot of each key column (``B`` is ``bs`` in decode,
        1 in extend, where every query reads the same prompt row).
    mask: bool ``[B, 1, R, T]``, True where a query row may read a key column
        (``R`` = query heads per KV head in decode, ``tokens * that`` in extend).
    decode: one query token per row (decode) rather than a whole prompt (extend).
    keys: bool ``[B, T, 1, 1]``, True where a column holds a live key of the row
        (decode); None where every column is some query's live key (extend).
    paged: the rows for the Triton kernel (decode with ``kernel="triton"``),
        which then replaces the gather; None for the torch attention.
    """

    slots: torch.Tensor
    mask: torch.Tensor
    decode: bool
    keys: torch.Tensor | None = None
    paged: PagedRows | None = None


def attend(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: AttnMetadata, scale: float
) -> torch.Tensor:
    """Grouped-query attention over gathered KV slots.

    q: ``[B, H_kv, R, D]``, the query rows that share each KV head.
    k_buf, v_buf: the layer's KV pool, ``[num_slots + page_size, H_kv, D]``.
    Returns ``[B, H_kv, R, D]`` in q's dtype; softmax runs in float32 as in transformers.
    """
    if meta.paged is not None:
        return paged_attention(q, k_buf, v_buf, meta.paged, scale)
    k = k_buf[meta.slots].transpose(1, 2)  # [B, H_kv, T, D]
    v = v_buf[meta.slots]
    if meta.keys is not None:
        # Masked columns read slot 0, the padding sink: a zero probability times
        # a non-finite value there would be NaN, so their values are zeroed.
        v = v.masked_fill(~meta.keys, 0)
    v = v.transpose(1, 2)
    if meta.decode:
        # A broadcast product summed over D, not a matmul: compiled, the key gather
        # fuses into the reduction and the gathered keys are never written out
        # (the CPU step runs ~1.5x faster). Eager it costs about what the matmul
        # does at decode sizes; a prompt's [T, T] scores take the matmul.
        scores = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) * scale
    else:
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~meta.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class PagedAttention(nn.Module):
    """Llama self-attention over a paged KV cache (q/k/v/o projections, no biases).

    ``forward(x [n, hidden], positions [n], out_loc [n], kv, meta, rotary)``
    writes the new tokens' K/V for layer ``layer_id`` at ``out_loc`` *before*
    reading, so a token attends to itself, then returns ``[n, hidden]``.
    The q/k/v projections run as one product over ``qkv_weight``, of which
    their weights are views (:func:`~graphrunner.model.fused.stack_weights`).
    """

    qkv_weight: torch.Tensor

    def __init__(
        self, config: ModelConfig, layer_id: int, *, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype)
        self._stack_qkv()

    def _stack_qkv(self) -> None:
        stacked = stack_weights([self.q_proj, self.k_proj, self.v_proj])
        self.register_buffer("qkv_weight", stacked, persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> PagedAttention:
        # Moving or casting the module gives each parameter fresh storage: restack.
        super()._apply(fn, recurse)
        self._stack_qkv()
        return self

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        kv: KVStore,
        meta: AttnMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        n, kv_width = x.shape[0], self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.qkv_weight).split(
            [self.num_heads * self.head_dim, kv_width, kv_width], dim=-1
        )
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        kv.set_kv(self.layer_id, out_loc, k, v)
        k_buf, v_buf = kv.get_kv(self.layer_id)
        out = attend(self._rows(q, meta.slots.shape[0]), k_buf, v_buf, meta, self.scale)
        return self.o_proj(self._unrows(out, n))

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


class TorchPagedBackend:
    """The :class:`graphrunner.declare.hooks.GraphBackend` of the torch paged attention.

    Plan/run split, made as small as this backend allows: the per-step metadata
    (slot gather + length mask, :meth:`decode_metadata`) is two fused ops that
    read only the batch tensors, so it runs inside the graph and the very same
    forward is the eager reference. What the hooks own is the host side:

    - ``init_graph_state``: checks once, before any capture, that row 0 of
      ``req_to_token`` is all zeros (padded rows gather it; it may sync here).
    - ``init_capture_metadata``: checks the capture view's width against
      ``max_bs`` (host shapes only).
    - ``validate_inputs`` (every step, graph or eager): checks the host
      mirrors: ``seq_lens_cpu`` in ``1..max_context_len`` (a longer sequence
      would be silently truncated by the fixed-width gather; a 0 would attend
      to nothing: NaN) and ``req_pool_indices_cpu`` in ``1..num_reqs``. Reads
      host memory only, never the device.
    - ``init_replay_metadata``: nothing to do.

    ``seq_len_fill_value`` is 1: a padded row attends to exactly one key, slot 0.

    ``kernel`` picks the decode attention: ``"torch"`` (the gather above, the
    reference) or ``"triton"`` (the split-KV kernel through an opaque op, with
    ``kv_heads`` and the batch size fixing its split count); prompts (extend)
    always take the torch attention. Settable until a runner captures. With
    ``heads`` and ``head_dim`` given, the Triton kernel's scratch is allocated
    here, for ``num_reqs`` rows, and grown to ``max_bs`` by ``init_graph_state``.
    ``layout`` is the Triton kernel's split launch (one of
    :data:`~graphrunner.model.kernels.decode_attention.LAYOUTS`; ``"per_head"``, the
    measured default, or ``"all_heads"``), settable like ``kernel``.
    """

    seq_len_fill_value: int = 1

    def __init__(
        self,
        req_to_token: torch.Tensor,
        *,
        kernel: str = "torch",
        kv_heads: int = 1,
        heads: int = 0,
        head_dim: int = 0,
        layout: str = "per_head",
    ) -> None:
        self.req_to_token = req_to_token  # int32 [num_reqs + 1, max_context_len]
        self.max_context_len = req_to_token.shape[1]
        self.kv_columns = torch.arange(self.max_context_len, device=req_to_token.device)
        self.max_bs = 0
        self.kv_heads, self.heads, self.head_dim = kv_heads, heads, head_dim
        self.scratch: DecodeScratch | None = None
        self.kernel = kernel
        self.layout = layout

    def use(self, attention: str) -> None:
        """Run the decode attention named ``attention`` (a key of :data:`ATTENTIONS`)."""
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: expected one of {tuple(ATTENTIONS)}")
        self.kernel, self.layout = ATTENTIONS[attention]

    @property
    def layout(self) -> str:
        """The Triton kernel's split launch: ``"per_head"`` or ``"all_heads"``."""
        return self._layout

    @layout.setter
    def layout(self, layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
        self._layout = layout

    @property
    def kernel(self) -> str:
        """The decode attention: ``"torch"`` or ``"triton"``."""
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: str) -> None:
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"kernel={kernel!r}: expected one of {ATTENTION_KERNELS}")
        self._kernel = kernel
        self._size_scratch(self.req_to_token.shape[0] - 1)

    def _size_scratch(self, rows: int) -> None:
        """Scratch for ``rows`` decode rows, allocated only when the Triton kernel
        runs and the current one is smaller (host-side, never in a step)."""
        if self._kernel != "triton" or not self.heads or not self.head_dim:
            return
        if self.scratch is None or self.scratch.partial_out.shape[0] < rows:
            self.scratch = DecodeScratch.allocate(
                rows, self.heads, self.head_dim, device=self.req_to_token.device
            )

    def decode_metadata(self, inputs: StepInputs, group: int) -> AttnMetadata:
        """Slots ``[bs, max_context_len]`` and mask ``[bs, 1, group, max_context_len]``."""
        return self.rows_metadata(inputs.req_pool_indices, inputs.seq_lens, group)

    def rows_metadata(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, group: int
    ) -> AttnMetadata:
        """:meth:`decode_metadata` of rows given as tensors (int64 ``[n]``): each
        row reads ``req_to_token[req_pool_indices, :seq_lens]``."""
        mask = self.kv_columns < seq_lens[:, None]
        # Columns past seq_len read slot 0 instead of whatever stale slot the row
        # holds there: their scores are masked anyway, and one hot row costs far
        # less than a scattered read per column.
        slots = torch.where(mask, self.req_to_token[req_pool_indices], 0).long()
        paged = None
        if self._kernel == "triton":
            splits = choose_splits(
                seq_lens.shape[0], self.kv_heads, self.max_context_len, layout=self._layout
            )
            paged = PagedRows(
                self.req_to_token, req_pool_indices, seq_lens, splits, self.scratch, self._layout
            )
        return AttnMetadata(
            slots,
            mask[:, None, None, :].expand(-1, 1, group, -1),
            decode=True,
            keys=mask[:, :, None, None],
            paged=paged,
        )

    def extend_metadata(
        self, req_pool_index: int, positions: torch.Tensor, width: int, group: int
    ) -> AttnMetadata:
        """Causal metadata for one request whose new tokens sit at ``positions [n]``
        (the last one is ``width - 1``): slots ``[1, width]``, mask
        ``[1, 1, n * group, width]``."""
        slots = self.req_to_token[req_pool_index, :width].long()[None, :]
        mask = self.kv_columns[:width] <= positions[:, None]  # [n, width]
        mask = mask[:, None, :].expand(-1, group, -1).reshape(1, 1, -1, width)
        return AttnMetadata(slots, mask, decode=False)

    def init_graph_state(self, max_bs: int) -> None:
        if int(self.req_to_token[0].abs().sum()) != 0:
            raise ValueError(
                "req_to_token row 0 is not all zeros; padded rows would read "
                "live KV slots (row 0 is reserved for padding)"
            )
        self.max_bs = max_bs
        self._size_scratch(max_bs)

    def init_capture_metadata(self, bs: int, view: BufferView) -> None:
        if not 1 <= bs <= self.max_bs or view.bs != bs:
            raise ValueError(
                f"capture bs={bs} (view of {view.bs} rows): "
                f"expected 1..max_bs={self.max_bs} rows; call init_graph_state first"
            )

    def validate_inputs(self, raw_bs: int, inputs: object) -> None:
        self._check_host_range("req_pool_indices_cpu", inputs, 1, self.req_to_token.shape[0] - 1)
        self._check_host_range("seq_lens_cpu", inputs, 1, self.max_context_len)

    def _check_host_range(self, name: str, inputs: object, lo: int, hi: int) -> None:
        """Every value of host mirror ``name`` in ``lo..hi`` (host reads only)."""
        values = getattr(inputs, name, None)
        if not isinstance(values, torch.Tensor):
            raise ValueError(
                f"{name} is {type(values).__name__}; this backend needs the host mirror "
                f"(CPU int64 [bs])"
            )
        bounds = host_range(inputs, name, values)
        if bounds is None:
            return
        low, high = bounds
        if low < lo or high > hi:
            bad = int(((values < lo) | (values > hi)).nonzero()[0, 0])
            raise ValueError(f"{name}[{bad}]={int(values[bad])}: expected {lo}..{hi}")

    def init_replay_metadata(self, bs: int, raw_bs: int, view: BufferView, inputs: object) -> None:
        pass  # the metadata is computed inside the graph from the static buffers
