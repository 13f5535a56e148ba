"""The float64 oracle of a prompt chunk's attention, which the C++ prompt
attentions (``tests/test_prompt_attention.py``, ``tests/test_prompt_attention_bf16.py``)
and their torch twin must meet: token ``i`` of ``n`` reading slots
``0 .. L - n + i``, each query head its KV head, softmax in float64."""

from __future__ import annotations

import torch

from graphrunner_ref.model.attention_torch import read_kv


def prompt_oracle(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    n, heads, dim = q.shape
    k_scale, v_scale = (None, None) if scales is None else scales
    k = read_kv(k_buf, slots, torch.float64, k_scale)  # [L, H_kv, D]
    v = read_kv(v_buf, slots, torch.float64, v_scale)
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    length = slots.shape[0]
    keys = torch.arange(length)
    mask = keys[None, :] <= (length - n + torch.arange(n)[:, None])
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).reshape(n, heads * dim)
