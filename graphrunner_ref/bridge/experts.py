"""Mixture-of-experts rows that never feel their neighbours.

transformers' expert implementations (its loop over experts, ``grouped_mm``,
``batched_mm``) group a step's rows by expert, so the shapes of the expert
products, and the bits of a live row's output, depend on which experts the
other rows (padded ones included) chose. The bridge registers its own
implementation with transformers' experts interface (``ExpertsInterface``,
the ``@use_experts_implementation`` experts modules of Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, ...) under :data:`EXPERTS`: each row runs its own top-k
experts, their weights gathered by the row's own expert indices, as
broadcast products summed over the input (a row's sums never see another
row), then the row's routing weights combine its k outputs. Everything
around the experts stays the model's own: the router and its weight
normalisation, shared experts, biases, the gate's activation, a post-expert
norm. Shapes are static (no grouping by expert), so the step captures.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from graphrunner.util import needs_extra

__all__ = ["EXPERTS", "install_experts", "row_experts_forward"]

#: The name the bridge registers with transformers' experts interface.
EXPERTS = "graphrunner"


def _project(
    x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """Each row's product with each of its experts: ``x [N, k or 1, in]``,
    ``weight [E, out, in]`` (``[E, in, out]`` when ``transposed``), ``index
    [N, k]``; ``[N, k, out]``. Compiled, the gather fuses into the sum."""
    picked = weight[index]  # [N, k, out, in] or [N, k, in, out]
    if transposed:
        return (picked * x[:, :, :, None]).sum(-2)
    return (picked * x[:, :, None, :]).sum(-1)


def row_experts_forward(
    self: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' experts forward, row by row (``self``: an experts module
    of ``@use_experts_implementation``): ``hidden_states [N, H]``,
    each row's experts ``top_k_index [N, k]`` and routing weights
    ``top_k_weights [N, k]``; ``[N, H]`` in the input's dtype. Honours the
    experts module's layout flags as transformers' own implementations do
    (``has_gate``, ``has_bias``, ``is_transposed``, ``has_post_expert_norm``)."""
    transposed = bool(getattr(self, "is_transposed", False))
    has_gate, has_bias = bool(self.has_gate), bool(self.has_bias)
    up = self.gate_up_proj if has_gate else self.up_proj
    proj = _project(hidden_states[:, None, :], up, top_k_index, transposed)  # [N, k, out]
    if has_bias:
        bias = self.gate_up_proj_bias if has_gate else self.up_proj_bias
        proj = proj + bias[top_k_index]
    proj = self._apply_gate(proj) if has_gate else self.act_fn(proj)
    out = _project(proj, self.down_proj, top_k_index, transposed)  # [N, k, H]
    if has_bias:
        out = out + self.down_proj_bias[top_k_index]
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    # Summed over k in top-k order, as transformers' implementations do.
    weighted = out * top_k_weights[:, :, None]
    return weighted.sum(1).to(hidden_states.dtype)


def install_experts(hf: nn.Module) -> bool:
    """Run ``hf``'s experts through :func:`row_experts_forward` where they go
    through transformers' experts interface; whether they do (False: a dense
    model, or experts of its own)."""
    with needs_extra("text", "the transformers bridge"):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    can_set = getattr(type(hf), "_can_set_experts_implementation", None)
    if not callable(can_set) or not can_set():
        return False
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, row_experts_forward)
    hf.set_experts_implementation(EXPERTS)  # type: ignore[operator]
    return True
