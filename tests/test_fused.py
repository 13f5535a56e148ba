"""The q/k/v projections run as one product over a stacked weight whose rows
are the named parameters: loading weights, casting and moving keep them one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphrunner_ref.model import default_model
from graphrunner_ref.model.fused import stack_biases, stack_weights


def _views_of_stack(attn: nn.Module) -> bool:
    parts = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    return torch.equal(torch.cat(parts), attn.qkv_weight) and all(
        p.untyped_storage().data_ptr() == attn.qkv_weight.untyped_storage().data_ptr()
        for p in parts
    )


def test_named_parameters_are_rows_of_the_stack() -> None:
    bundle = default_model(max_requests=1)
    attn = bundle.model.model.layers[1].self_attn
    assert _views_of_stack(attn)
    with torch.no_grad():
        attn.k_proj.weight.fill_(0.5)  # how load_weights writes: in place
    rows = slice(attn.q_proj.weight.shape[0], -attn.v_proj.weight.shape[0])
    assert (attn.qkv_weight[rows] == 0.5).all()
    assert "qkv_weight" not in bundle.model.state_dict()  # names stay transformers'


def test_casting_restacks() -> None:
    bundle = default_model(max_requests=1)
    bundle.model.to(torch.bfloat16)
    attn = bundle.model.model.layers[0].self_attn
    assert attn.qkv_weight.dtype == torch.bfloat16 and _views_of_stack(attn)


def test_stack_weights_refuses_mismatched_linears() -> None:
    with pytest.raises(ValueError, match=r"weights \[\(4, 3\), \(4, 5\)\]"):
        stack_weights([nn.Linear(3, 4, bias=False), nn.Linear(5, 4, bias=False)])
    with pytest.raises(ValueError, match="every linear with a bias, or none"):
        stack_biases([nn.Linear(3, 4), nn.Linear(3, 4, bias=False)])
