"""Linears that read the same input, run as one matrix product.

A decode step at small batch sizes is a chain of matrix-vector products, each
a kernel launch that streams its weight once: the query, key and value
projections of a layer (the latter two small) cost three launches where one
product over their stacked weights does the same reads. The stacked weight is
the only copy: each linear's ``weight`` becomes a view of its rows, so
loading a checkpoint into the named parameters (``q_proj.weight``...) fills it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

__all__ = ["register_stack", "stack_biases", "stack_weights"]


def stack_weights(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """Stack the weights of ``linears`` (``[out_i, in]`` each, one ``in``,
    dtype and device) into one ``[sum(out_i), in]`` tensor, and make each
    linear's weight a parameter viewing its rows. Returns the stacked tensor
    (:func:`stack_biases` stacks their biases the same way).

    Call it again after anything that replaces the parameters' storage
    (``Module.to``): the views are then rebuilt over a fresh stack.
    """
    weights = [m.weight for m in linears]
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(
            f"stack_weights: weights {[tuple(w.shape) for w in weights]}: expected linears "
            "with one input size"
        )
    return _stack_parameters(linears, "weight")


def stack_biases(linears: Sequence[nn.Linear]) -> torch.Tensor | None:
    """Stack the biases of ``linears`` into one ``[sum(out_i)]`` tensor, each
    linear's bias a parameter viewing its part; None where none has a bias
    (all or none must)."""
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("stack_biases: expected every linear with a bias, or none")
    return _stack_parameters(linears, "bias")


def register_stack(module: nn.Module, name: str, linears: Sequence[nn.Linear]) -> None:
    """Stack ``linears`` (:func:`stack_weights`, :func:`stack_biases`) into
    ``module``'s non-persistent buffers ``{name}_weight`` and ``{name}_bias``
    (None without biases); call it again after the parameters' storage is
    replaced (``Module._apply``)."""
    module.register_buffer(f"{name}_weight", stack_weights(linears), persistent=False)
    module.register_buffer(f"{name}_bias", stack_biases(linears), persistent=False)


def _stack_parameters(linears: Sequence[nn.Linear], name: str) -> torch.Tensor:
    """Parameter ``name`` of every linear concatenated along dim 0, each
    linear's own parameter then a view of its rows of the stack."""
    params = [cast(nn.Parameter, getattr(m, name)) for m in linears]
    with torch.no_grad():
        stacked = torch.cat([p.detach() for p in params])
    parts = stacked.split([p.shape[0] for p in params])
    for m, p, part in zip(linears, params, parts, strict=True):
        setattr(m, name, nn.Parameter(part, requires_grad=p.requires_grad))
    return stacked
