"""Copying a transformers-named state dict into a module, all checked first."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from graphrunner.model.config import CheckpointError

__all__ = ["WeightError", "copy_checked_weights"]


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
    missing = sorted(set(params) - set(given))
    unexpected = sorted(set(given) - set(params))
    if missing:
        raise WeightError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise WeightError(
            f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)"
        )
    for name, param in params.items():
        if given[name].shape != param.shape:
            raise WeightError(
                f"tensor {name!r} has shape {tuple(given[name].shape)}: "
                f"expected {tuple(param.shape)}"
            )
    for name, param in params.items():
        param.copy_(given[name].to(param.dtype))
