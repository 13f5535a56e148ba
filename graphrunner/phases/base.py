"""What the speculative phases share: a captured width, and their inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec
from graphrunner.mechanisms.base import ForwardFn

__all__ = ["SpecBatch", "WidthRunner", "batch_width"]


class SpecBatch:
    """The inputs of a speculative step: named device tensors plus the host
    mirrors ``req_pool_indices_cpu`` and ``seq_lens_cpu`` (CPU int64 ``[bs]``).

    ``batch_size`` comes from the host mirror (never a device read); ``width``
    (tokens per request of the per-token fields) is given or read from the
    host-side shape of ``input_ids``.
    """

    def __init__(
        self,
        *,
        req_pool_indices_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        **tensors: torch.Tensor,
    ) -> None:
        self.req_pool_indices_cpu = req_pool_indices_cpu
        self.seq_lens_cpu = seq_lens_cpu
        self.__dict__.update(tensors)

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices_cpu.shape[0])


def batch_width(inputs: Any, raw_bs: int) -> int | None:
    """Tokens per request of ``inputs``' per-token fields (host shapes only)."""
    ids = getattr(inputs, "input_ids", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() == 0 or raw_bs < 1:
        return None
    return int(ids.shape[0]) // raw_bs


class WidthRunner(GraphRunner):
    """A phase captured at ``width`` tokens per request; a batch of another
    width runs eagerly, counted and warned once, like any other fallback.

    Args:
        forward, specs: as :class:`GraphRunner`.
        width: tokens per request of the per-token buffers.
        **kwargs: the other :class:`GraphRunner` arguments.
    """

    def __init__(
        self, forward: ForwardFn, specs: Sequence[BufferSpec], *, width: int, **kwargs: Any
    ) -> None:
        super().__init__(forward, specs, **kwargs)
        self.width = width

    def eager_reason(self, inputs: Any, raw_bs: int) -> str | None:
        reason = super().eager_reason(inputs, raw_bs)
        if reason is not None:
            return reason
        width = batch_width(inputs, raw_bs)
        if width is not None and width != self.width:
            return f"batch width {width} differs from the captured width {self.width}"
        return None


def check_width(name: str, value: object) -> int:
    """``value`` as a width (an int >= 1), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    return value
