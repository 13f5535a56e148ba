"""Inductor programs called directly: the CPU runner's mechanism.

On CPU there is no graph to replay; a compiled program over the static
buffers plays that part: one program with a symbolic batch dimension for
every size (or, with ``dynamic_batch=False``, one shape-specialised program
per size). Replay calls it directly
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
from graphrunner.declare.outputs import Outputs
from graphrunner.mechanisms.base import CaptureMechanism, ForwardFn, Launcher
from graphrunner.mechanisms.compile import SizeCompiler, inductor_patches

__all__ = ["InductorCapture"]


class InductorCapture(CaptureMechanism):
    """One inductor program for every size (or one per size), called directly.

    Args:
        dynamic_batch: compile once with a symbolic batch dimension and call
            that program at every size (True, the default), or compile one
            shape-specialised program per size (False).
        fullgraph: refuse a forward with a graph break (a host sync, a branch
            on a tensor's value) with ``UncapturableError`` naming the line,
            instead of running that size through dynamo piecewise.
        compile_mode: a ``torch.compile`` mode whose inductor options apply
            (those that turn on inductor's CUDA graphs are refused).
        inductor_options: inductor config patches, as ``torch.compile(options=...)``.
    """

    kind = "cpu"
    #: None: capture itself runs the step outside any graph (compiling it,
    #: or reusing the one program) and records the program's arguments.
    warmup_runs = 0

    def __init__(
        self,
        *,
        compile_mode: str | None = None,
        inductor_options: Mapping[str, Any] | None = None,
        dynamic_batch: bool = True,
        fullgraph: bool = False,
    ) -> None:
        patches = inductor_patches(compile_mode, inductor_options)
        self.compiler = SizeCompiler(patches, dynamic=dynamic_batch, fullgraph=fullgraph)

    @property
    def direct_fallbacks(self) -> int:
        """Sizes that run through dynamo because their program cannot be called directly."""
        return self.compiler.direct_fallbacks

    @property
    def compilations(self) -> int:
        return self.compiler.compilations

    @property
    def cache_hits(self) -> int:
        return self.compiler.cache_hits

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        return self.compiler.step_fn(bs, forward, view)

    def capture(self, bs: int, fn: Launcher) -> Launcher:
        return self.compiler.launcher(bs, fn)

    def captured_outputs(self) -> Outputs | None:
        return self.compiler.recorded

    def drop(self) -> None:
        self.compiler.drop()

    def programs(self, bs: int) -> int:
        return self.compiler.programs(bs)
