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

The program calls its kernels from inductor's Python wrapper, a line of
Python per kernel and buffer; ``inductor_options=CPP_WRAPPER`` compiles the
wrapper to C++ (SmolLM2 at batch 1: 1.05x decode, a slower cold capture;
:attr:`InductorCapture.wrapper` says which runs). The wrapper is generated
without its size and stride asserts (:data:`DIRECT_CALL_OPTIONS`): replay
passes the program the very tensors it was captured with, so an assert per
input per call would check what cannot have changed.

``aot_cache=DIR``: the program saved and loaded without tracing (:mod:`.aot`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from graphrunner.declare.buffers import BufferView
from graphrunner.declare.outputs import Outputs
from graphrunner.mechanisms.base import CaptureMechanism, ForwardFn, Launcher, SplitForward

__all__ = ["CPP_WRAPPER", "DIRECT_CALL_OPTIONS", "InductorCapture"]

#: Inductor options under the caller's ``inductor_options`` (which may set them
#: back): no size and stride asserts in the program's wrapper. Each is a call
#: per input tensor (every weight is one) on every replay, about 640 a step for
#: SmolLM2, checking tensors that replay never changes (the program is called
#: with the arguments it was captured with); without them SmolLM2 decodes at
#: batch 1 1.04-1.08x faster (int4-q8, int4), the embedded model 1.07-1.22x
#: (``bench/results/size-asserts-cpu.md``).
DIRECT_CALL_OPTIONS: Mapping[str, Any] = {"size_asserts": False}

#: ``inductor_options`` for inductor's C++ wrapper, its entry built apart from
#: the kernels (built whole, SmolLM2's cold capture took 267 s, not 115 s).
CPP_WRAPPER: Mapping[str, Any] = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


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
        inductor_options: inductor config patches, as ``torch.compile(options=...)``,
            over :data:`DIRECT_CALL_OPTIONS` (:data:`CPP_WRAPPER`: the wrapper in C++).
        aot_cache, aot_key: a folder where the program is saved and loaded
            without tracing, and more fields its key holds (:mod:`.aot`).
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
        aot_cache: str | os.PathLike[str] | None = None,
        aot_key: Mapping[str, str] | None = None,
    ) -> None:
        from graphrunner.mechanisms.compile import SizeCompiler, inductor_patches  # at first use

        patches = inductor_patches(
            compile_mode, {**DIRECT_CALL_OPTIONS, **(inductor_options or {})}
        )
        self.compiler = SizeCompiler(patches, dynamic=dynamic_batch, fullgraph=fullgraph)
        self._pending: dict[int, tuple[ForwardFn, BufferView]] = {}
        self._saved_outputs: Outputs | None = None
        #: True once a split step's head was saved: its tail runs in process.
        self.tail_in_process = False
        self.aot: Any = None  # an AotPrograms, imported only when asked for
        if aot_cache is not None or aot_key is not None:
            from graphrunner.mechanisms.aot import AotPrograms

            self.aot = AotPrograms(aot_cache, aot_key, patches, dynamic_batch)

    @property
    def aot_status(self) -> str | None:
        """With ``aot_cache``: ``loaded``, ``built (why)`` or ``refused (why)``;
        of a split step's head, followed by ``; the tail in process``."""
        if self.aot is None:
            return None
        status: str = self.aot.status
        return f"{status}; the tail in process" if self.tail_in_process else status

    @property
    def wrapper(self) -> str:
        """The wrapper the step's program calls its kernels from: ``c++`` or ``python``."""
        return "c++" if self.compiler.patches.get("cpp_wrapper") else "python"

    @property
    def direct_fallbacks(self) -> int:
        """Sizes that run through dynamo because their program cannot be called directly."""
        return self.compiler.direct_fallbacks

    @property
    def compilations(self) -> int:
        return self.compiler.compilations + (self.aot.compilations if self.aot else 0)

    @property
    def cache_hits(self) -> int:
        return self.compiler.cache_hits + (self.aot.cache_hits if self.aot else 0)

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        if self.aot is None or not self.aot.active:
            return self.compiler.step_fn(bs, forward, view)
        self._pending[bs] = (forward, view)
        return lambda: forward(view)

    def capture(self, bs: int, fn: Launcher) -> Launcher:
        self._saved_outputs = None
        if bs in self._pending:
            forward, view = self._pending.pop(bs)
            launcher = self._saved(bs, forward, view)
            if launcher is not None:
                return launcher
            fn = self.compiler.step_fn(bs, forward, view)
        return self.compiler.launcher(bs, fn)

    def _saved(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher | None:
        """Size ``bs``'s launcher of the saved program, None where it cannot
        be saved. Of a :class:`SplitForward` the head is saved, and its tail
        runs after it eagerly (a sampler that sorts only where a row samples)."""
        if not isinstance(forward, SplitForward):
            launcher = self.aot.capture(bs, forward, view)
            if launcher is not None:
                self._saved_outputs = self.aot.recorded
            return launcher
        head = self.aot.capture(bs, forward.head, view, part="head")
        if head is None:
            return None
        tail = forward.tail
        self.tail_in_process = True
        self._saved_outputs = tail(self.aot.recorded, view)
        return lambda: tail(head(), view)

    def captured_outputs(self) -> Outputs | None:
        return self.compiler.recorded if self._saved_outputs is None else self._saved_outputs

    def drop(self) -> None:
        self.compiler.drop()
        self._pending.clear()

    def programs(self, bs: int) -> int:
        return self.compiler.programs(bs) + (self.aot is not None and self.aot.first == bs)
