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
    """Compiles the forward once per captured size with inductor
    (``torch.compile(dynamic=False)``, one code object per size) and replays
    by calling each size's program directly, padded.

    Args:
        forward, specs, device: as :class:`GraphRunner`.
        compile_mode: a ``torch.compile`` mode whose inductor options apply.
        inductor_options: inductor config patches (as ``torch.compile(options=...)``).
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
        **kwargs: Any,
    ) -> None:
        mechanism = InductorCapture(compile_mode=compile_mode, inductor_options=inductor_options)
        super().__init__(forward, specs, device=device, mechanism=mechanism, **kwargs)
