"""The capture mechanism: how one size is prepared, warmed up, captured and
launched. A runner composes one; the phase (buffers, outputs, forward) is
the runner's, the mechanism knows nothing of it."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar, Protocol

import torch

from graphrunner.declare.buffers import BufferView, Size, StaticBuffers
from graphrunner.declare.outputs import Outputs

__all__ = ["CaptureMechanism", "ForwardFn", "Launcher", "PopulateWriter", "SplitForward"]

#: The model's step: called with one argument, a
#: :class:`~graphrunner.declare.buffers.BufferView` of the phase's declared
#: buffers by name (the padded static buffers at capture and replay, the live
#: rows on the eager path).
ForwardFn = Callable[..., Outputs]
#: Runs a captured size on the static buffers; returns its static outputs.
Launcher = Callable[[], Outputs]


class SplitForward:
    """A step in two parts: ``head(view)``, the model (its outputs), then
    ``tail(head_outputs, view)``, what reads them (a sampler). Called, it is
    the whole step, and a mechanism compiles it whole. The sampled decode
    step (:func:`~graphrunner.phases.sampled.sampled_forward`): the head
    returns logits float32 ``[bs, vocab]``, the tail ``{"logits": [bs,
    vocab], "tokens": int64 [bs]}`` and, with log-probabilities, their rows.

    The split is for a program saved ahead of time (the CPU mechanism's
    ``aot_cache``): the tail's work depends on the live rows (the sampler's
    sort runs only where a row samples, ``torch.cond``), which a saved
    program cannot branch on. The head is saved and loaded; the tail runs
    after it in process, eagerly, where such a branch reads a host flag.
    """

    __slots__ = ("head", "tail")

    def __init__(self, head: ForwardFn, tail: Callable[[Outputs, BufferView], Outputs]) -> None:
        self.head = head
        self.tail = tail

    def __call__(self, view: BufferView) -> Outputs:
        return self.tail(self.head(view), view)


class PopulateWriter(Protocol):
    """Writes validated sources into the static buffers (another executor of
    the same declarations as :func:`graphrunner.writers.base.write_sources`,
    which it must equal bit for bit)."""

    def write(self, sources: Sequence[torch.Tensor], raw_bs: Size, bs: Size) -> int:
        """Write ``raw_bs`` live requests padded to ``bs``; return the device
        operations issued outside the graph."""
        ...


class CaptureMechanism(abc.ABC):
    """How a size is captured and launched.

    The capture loop calls, per size (largest first): :meth:`step_fn`, then
    :meth:`warmup` (twice), then :meth:`capture`; :meth:`memory_bytes`
    around it. :meth:`drop` forgets every size (a failed capture).
    """

    #: The runner kind this mechanism is known by (``cuda``, ``cpu``, ``eager``).
    kind: ClassVar[str]
    #: Who writes the buffers at replay; None: the torch populate.
    populate_writer: PopulateWriter | None = None
    #: Runs of each size before :meth:`capture` (the first checks the
    #: outputs against their declaration): lazy initialisation happens
    #: outside a graph. A mechanism whose capture itself runs the step
    #: outside any graph needs none (its :meth:`captured_outputs` are checked).
    warmup_runs: int = 2
    #: Collect, then freeze the heap before capture: its collections scan only its objects.
    freezes_heap: bool = True

    @property
    def label(self) -> str:
        """How reports and progress bars name this mechanism."""
        return self.kind

    def bind(self, device: torch.device) -> None:
        """Called once with the buffers' device; refuse a device it cannot use."""
        return None

    def bind_buffers(self, buffers: StaticBuffers) -> None:
        """Called once with the runner's buffers (a mechanism that populates
        in its own way plans its writer here)."""
        return None

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        """The callable warmed up and captured for size ``bs``."""
        tensors = view
        return lambda: forward(tensors)

    def warmup(self, fn: Launcher) -> Outputs:
        """Run ``fn`` once outside capture (lazy initialisation, compilation)."""
        return fn()

    @abc.abstractmethod
    def capture(self, bs: int, fn: Launcher) -> Launcher:
        """Capture ``fn`` for size ``bs``; return what replays it."""

    def captured_outputs(self) -> Outputs | None:
        """The outputs the last :meth:`capture` computed running the step
        (a mechanism with no warm-up), or None."""
        return None

    def drop(self) -> None:
        """Forget every captured size and free what it holds."""
        return None

    def memory_bytes(self) -> int | None:
        """Bytes the captures hold now (a graph memory pool), or None where
        this mechanism holds none or cannot measure it."""
        return None

    @property
    def direct_fallbacks(self) -> int:
        """Compiled sizes launched through dynamo, not their program called directly."""
        return 0

    @property
    def compilations(self) -> int:
        """Compilations so far (0 where nothing is compiled); replays add none."""
        return 0

    @property
    def cache_hits(self) -> int:
        """Of :attr:`compilations`, those a compile cache answered (a warm start)."""
        return 0

    def programs(self, bs: int) -> int | None:
        """Compiled programs of size ``bs``, or None where nothing is compiled."""
        return None
