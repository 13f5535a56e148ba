"""Mixture-of-experts rows that never feel their neighbours.

transformers' expert implementations (its loop over experts, ``grouped_mm``,
``batched_mm``) group a step's rows by expert, so the shapes of the expert
products, and the bits of a live row's output, depend on which experts the
other rows (padded ones included) chose. The bridge registers its own
implementation with transformers' experts interface (``ExpertsInterface``,
the ``@use_experts_implementation`` experts modules of Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, ...) under :data:`EXPERTS`: each row runs its own top-k
experts (compiled or captured: their weights gathered by the row's own
expert indices, as broadcast products summed over the input; eagerly: one
product per row and expert on the expert's own weight, never a copy), so a
row's sums never see another row; then the row's routing weights combine
its k outputs. Everything
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
    [N, k]``; ``[N, k, out]``. Compiled or captured, the experts are gathered
    by index (compiled, the gather fuses into the sum; a graph cannot read
    the indices on the host); eagerly, :func:`_project_each`."""
    if torch.compiler.is_compiling() or _graph_capturing(weight):
        picked = weight[index]  # [N, k, out, in] or [N, k, in, out]
        if transposed:
            return (picked * x[:, :, :, None]).sum(-2)
        return (picked * x[:, :, None, :]).sum(-1)
    return _project_each(x, weight, index, transposed)


def _graph_capturing(weight: torch.Tensor) -> bool:
    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


def _project_each(
    x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """:func:`_project` one product per (row, expert) on the expert's own
    weight: an eager gather would copy k experts' weights for every row
    (hundreds of MB a row on a real model's prompt). Still row by row, so a
    row's bits never depend on its neighbours."""
    rows = []
    for n, experts in enumerate(index.tolist()):
        inputs = x[n].expand(len(experts), -1)  # [k, in]: one input, or one per expert
        rows.append(
            torch.stack(
                [
                    inputs[j] @ weight[e] if transposed else weight[e] @ inputs[j]
                    for j, e in enumerate(experts)
                ]
            )
        )
    return torch.stack(rows) if rows else x.new_empty(0, index.shape[1], _out(weight, transposed))


def _out(weight: torch.Tensor, transposed: bool) -> int:
    return weight.shape[2] if transposed else weight.shape[1]


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
