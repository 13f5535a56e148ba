"""Building blocks of a Llama-style decoder: RMSNorm, rotary embedding, SwiGLU MLP.

Each follows the Hugging Face Llama arithmetic op for op, so logits agree with
``transformers`` to float32 rounding, not just approximately.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner_ref.model.fused import register_stack


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32.

    Input ``[..., hidden]`` of any float dtype; output has the input's dtype.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table.

    The table is ``[max_positions, head_dim]`` float32, built with the same ops as
    transformers (``position * inv_freq`` in float32, then cos/sin), so a table
    lookup equals computing it on the fly bit for bit, and costs one gather.
    Positions must lie in ``[0, max_positions)``; padded rows use position 0.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    #: Whether :meth:`forward` rotates every dim of every head by the tables
    #: (:func:`rotate`), so a fused rotary + KV write may run in its place;
    #: False in a subclass that rotates otherwise.
    table_rotation: bool = True

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scale is not None:  # e.g. Llama 3.1's scaling of the frequencies
            inv_freq = scale(inv_freq)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [n, H, D]`` and ``k [n, H_kv, D]`` at ``positions [n]`` (int64)."""
        cos, sin = rotary_rows(self.cos, self.sin, positions, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def rotary_rows(
    cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' rows at ``positions [n]`` in ``dtype``, ``[n, 1, D]`` each."""
    return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [n, heads, D]`` rotated by :func:`rotary_rows`' ``cos`` and ``sin``:
    ``x * cos + rotate_half(x) * sin`` (element ``i`` paired with ``i + D / 2``).

    ``rotate_half(x) * sin`` is taken as ``roll(x, D / 2) * (sin negated on
    the first half)``: the same products bit for bit (a negation is exact),
    in one elementwise expression. ``torch.cat`` of the two halves made
    inductor write them as aliased views of one buffer, each a Python call a
    step in the CPU runner's wrapper (SmolLM2's step: 210 such calls, 32
    now); the CPU runner's SmolLM2 int4-q8 batch-1 decode ran 1.02x as fast
    this way (``bench/results/rotation-roll-int4-q8-cpu.md``, the same tokens)."""
    half = x.shape[-1] // 2
    first_half = torch.arange(x.shape[-1], device=x.device) < half
    return x * cos + torch.roll(x, half, dims=-1) * torch.where(first_half, -sin, sin)


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, biases with ``bias``. ``[..., hidden] -> [..., hidden]``.

    Gate and up read the same input: they run as one product over
    ``gate_up_weight`` (``[2 * inter, hidden]``), of which their weights are
    views (:func:`~graphrunner_ref.model.fused.stack_weights`), or, once
    :meth:`quantize` ran, as ``gate_up_proj`` (a compact linear): one call
    where there were two.
    """

    gate_up_weight: torch.Tensor
    gate_up_bias: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype | None = None,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj: nn.Module = nn.Linear(
            intermediate_size, hidden_size, bias=bias, dtype=dtype
        )
        #: The stacked gate/up projection once quantized (None: ``gate_up_weight``).
        self.gate_up_proj: nn.Module | None = None
        self._stack_gate_up()

    def _stack_gate_up(self) -> None:
        register_stack(self, "gate_up", [self.gate_proj, self.up_proj])

    def _apply(self, fn: Any, recurse: bool = True) -> SwiGLUMLP:
        # Moving or casting the module gives each parameter fresh storage: restack.
        super()._apply(fn, recurse)
        if self.gate_up_proj is None:
            self._stack_gate_up()
        return self

    def quantize(self, make: Callable[[torch.Tensor], nn.Module]) -> None:
        """Replace the stacked gate/up and the down projections by ``make(weight)``
        (a compact linear); the float weights are dropped."""
        self.gate_up_proj = make(self.gate_up_weight)
        self.down_proj = make(cast(torch.Tensor, self.down_proj.weight))
        del self.gate_proj, self.up_proj, self.gate_up_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = (
            F.linear(x, self.gate_up_weight, self.gate_up_bias)
            if self.gate_up_proj is None
            else self.gate_up_proj(x)
        )
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
