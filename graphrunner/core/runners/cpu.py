"""The CPU runner: a :class:`GraphRunner` over :class:`InductorCapture`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec
from graphrunner.mechanisms import InductorCapture
from graphrunner.mechanisms.base import ForwardFn

__all__ = ["CpuGraphRunner"]


class CpuGraphRunner(GraphRunner):
    """Compiles the forward once with inductor, the batch dimension symbolic,
    and replays by calling that program directly at each captured size,
    padded (``dynamic_batch=False``: one shape-specialised program per size).

    Args:
        forward, specs, device: as :class:`GraphRunner`.
        compile_mode: a ``torch.compile`` mode whose inductor options apply.
        inductor_options: inductor config patches (as ``torch.compile(options=...)``).
        dynamic_batch: one program for every size (default) or one per size.
        fullgraph: refuse a graph break by name (``UncapturableError``).
        **kwargs: the other :class:`GraphRunner` arguments.
    """

    def __init__(
        self,
        forward: ForwardFn,
        specs: Sequence[BufferSpec],
        *,
        device: torch.device | str,
        compile_mode: str | None = None,
        inductor_options: Mapping[str, Any] | None = None,
        dynamic_batch: bool = True,
        fullgraph: bool = False,
        **kwargs: Any,
    ) -> None:
        mechanism = InductorCapture(
            compile_mode=compile_mode,
            inductor_options=inductor_options,
            dynamic_batch=dynamic_batch,
            fullgraph=fullgraph,
        )
        super().__init__(forward, specs, device=device, mechanism=mechanism, **kwargs)
