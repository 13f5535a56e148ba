"""Inductor programs called directly: the CPU runner's mechanism.

On CPU there is no graph to replay; a compiled, shape-specialised program per
size over the static buffers plays that part. Replay calls it directly
(:class:`~graphrunner.mechanisms.compile.SizeCompiler`), skipping dynamo's
frame evaluation and guards (over a third of a small step's host time). A
size whose program cannot be called directly (a graph break, or outputs that
do not match the dynamo path at capture) keeps the dynamo path, counted in
``direct_fallbacks`` and warned once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphrunner.declare.buffers import BufferView
from graphrunner.mechanisms.base import CaptureMechanism, ForwardFn, Launcher
from graphrunner.mechanisms.compile import SizeCompiler, inductor_patches

__all__ = ["InductorCapture"]


class InductorCapture(CaptureMechanism):
    """One ``torch.compile(dynamic=False)`` program per size, called directly.

    Args:
        compile_mode: a ``torch.compile`` mode whose inductor options apply
            (those that turn on inductor's CUDA graphs are refused).
        inductor_options: inductor config patches, as ``torch.compile(options=...)``.
    """

    kind = "cpu"

    def __init__(
        self,
        *,
        compile_mode: str | None = None,
        inductor_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.compiler = SizeCompiler(inductor_patches(compile_mode, inductor_options))

    @property
    def direct_fallbacks(self) -> int:
        """Sizes that run through dynamo because their program cannot be called directly."""
        return self.compiler.direct_fallbacks

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        return self.compiler.step_fn(bs, forward, view)

    def capture(self, bs: int, fn: Launcher) -> Launcher:
        return self.compiler.launcher(bs, fn)

    def drop(self) -> None:
        self.compiler.drop()

    def programs(self, bs: int) -> int:
        return self.compiler.programs(bs)
