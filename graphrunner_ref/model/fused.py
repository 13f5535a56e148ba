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

import torch
from torch import nn

__all__ = ["stack_weights"]


def stack_weights(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """Stack the weights of bias-free ``linears`` (``[out_i, in]`` each, one
    ``in``, dtype and device) into one ``[sum(out_i), in]`` tensor, and make each
    linear's weight a parameter viewing its rows. Returns the stacked tensor.

    Call it again after anything that replaces the parameters' storage
    (``Module.to``): the views are then rebuilt over a fresh stack.
    """
    weights = [m.weight for m in linears]
    if any(m.bias is not None for m in linears) or len({w.shape[1] for w in weights}) != 1:
        raise ValueError(
            f"stack_weights: weights {[tuple(w.shape) for w in weights]}: expected bias-free "
            "linears with one input size"
        )
    with torch.no_grad():
        stacked = torch.cat([w.detach() for w in weights])
    rows = stacked.split([w.shape[0] for w in weights])
    for m, w, part in zip(linears, weights, rows, strict=True):
        m.weight = nn.Parameter(part, requires_grad=w.requires_grad)
    return stacked
