"""Copying a transformers-named state dict into a module, all checked first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from graphrunner_ref.model.config import CheckpointError

__all__ = ["WeightError", "check_weight_shapes", "copy_checked_weights", "layer_order"]


class WeightError(CheckpointError):
    """A checkpoint's tensors do not match the model: missing, unexpected or misshapen."""


@torch.no_grad()
def copy_checked_weights(model: nn.Module, given: Mapping[str, torch.Tensor]) -> None:
    """Copy ``given`` into ``model``'s parameters, each cast to its dtype.

    Every name and shape is checked before the first copy, so a bad
    checkpoint leaves the model as it was. Raises :class:`WeightError` naming
    the first missing, unexpected or misshapen tensor.
    """
    params = dict(model.named_parameters())
    check_weight_shapes(
        {n: tuple(t.shape) for n, t in given.items()},
        {n: tuple(p.shape) for n, p in params.items()},
    )
    for name, param in params.items():
        param.copy_(given[name].to(param.dtype))


def check_weight_shapes(
    given: Mapping[str, Sequence[int]], expected: Mapping[str, tuple[int, ...]], where: str = ""
) -> None:
    """:class:`WeightError` (prefixed with ``where``, if given) naming the first
    tensor that is missing, unexpected or misshapen in ``given`` (name -> shape)."""
    where = f"{where}: " if where else ""
    missing = sorted(set(expected) - set(given), key=layer_order)
    unexpected = sorted(set(given) - set(expected), key=layer_order)
    if missing:
        raise WeightError(f"{where}missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise WeightError(
            f"{where}unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)"
        )
    for name, shape in expected.items():
        if tuple(given[name]) != shape:
            raise WeightError(
                f"{where}tensor {name!r} has shape {tuple(given[name])}: expected {shape}"
            )


def layer_order(name: str) -> tuple[int, str]:
    # model.layers.2.x before model.layers.10.x: the first problem in file order.
    parts = name.split(".")
    index = int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else -1
    return index, name
