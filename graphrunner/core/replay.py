"""What a replay reaches: the graphs keyed by size and width, the batch size
of an inputs object, and the eager step for a batch above every captured size
(or of another width). The replay itself is :meth:`graphrunner.GraphRunner.replay`."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, cast

import torch

from graphrunner.core.input_check import check_host_mirrors
from graphrunner.core.observers import StepObserver
from graphrunner.declare.buffers import BufferView, StaticBuffers
from graphrunner.declare.hooks import GraphBackend
from graphrunner.declare.outputs import OutputLayout, Outputs
from graphrunner.declare.step_inputs import ReplayInputs, StepTensors
from graphrunner.mechanisms.base import ForwardFn, Launcher
from graphrunner.sizing.sizes import BatchSizeError
from graphrunner.writers.base import check_inputs, resolve_futures

__all__ = [
    "Graph",
    "GraphKey",
    "NotCapturedError",
    "StepParts",
    "batch_size_of",
    "check_host_mirrors",
    "run_eager",
]


class NotCapturedError(RuntimeError):
    """Replay asked for a size that was not captured (call ``capture()`` first)."""


def batch_size_of(inputs: ReplayInputs) -> int:
    """The live rows of ``inputs`` (its host-side ``batch_size``), at least 1."""
    raw_bs = getattr(inputs, "batch_size", None)
    if type(raw_bs) is int and raw_bs >= 1:  # the common case, one type test
        return raw_bs
    if isinstance(raw_bs, bool) or not isinstance(raw_bs, int):
        raise TypeError(
            f"{type(inputs).__name__} has no int batch_size (got {raw_bs!r}); replay takes "
            f"a graphrunner.DecodeInputs"
        )
    if raw_bs < 1:
        raise BatchSizeError(f"batch_size {raw_bs}: replay needs at least one live row")
    return int(raw_bs)


def validate_step(backend: GraphBackend, inputs: ReplayInputs, raw_bs: int) -> None:
    """What every step checks before it writes anything, graph or eager."""
    check_host_mirrors(inputs, raw_bs)
    backend.validate_inputs(raw_bs, inputs)


class StepParts(Protocol):
    """What the eager step reads of its runner (a :class:`~graphrunner.GraphRunner`)."""

    forward: ForwardFn
    buffers: StaticBuffers
    backend: GraphBackend
    outputs: OutputLayout

    def pre_launch(self) -> None:
        """Run once per step after the inputs passed their checks and before
        anything is written for the step (the recorded state ops)."""


class GraphKey(NamedTuple):
    """What a capture is keyed by: its batch size and tokens per row (the
    phase's width; 1 for one token per request)."""

    bs: int
    width: int


class Graph(NamedTuple):
    """One capture as a replay reaches it (looked up by raw batch size)."""

    key: GraphKey
    launcher: Launcher
    view: BufferView  # the buffers' rows for ``key.bs`` requests (what it reads)
    bs: int  # ``key.bs``, read once per replay


class _Resolved:
    """``inputs`` as the forward reads them from the buffers: host-produced
    fields on the device, future references resolved. The eager path reads
    its inputs directly, not through populate's buffers."""

    def __init__(self, inputs: ReplayInputs, buffers: StaticBuffers) -> None:
        self._inputs = inputs
        for spec in buffers.specs:
            given = getattr(inputs, spec.name)
            value = given.to(buffers.device_of(spec), non_blocking=True)  # given, if there
            if spec.future:
                value = value.clone() if value is given else value
                resolve_futures(value, buffers.future_tokens)
            if value is not given:
                setattr(self, spec.name, value)

    def __getattr__(self, name: str) -> torch.Tensor:
        value: torch.Tensor = getattr(self._inputs, name)
        return value

    @staticmethod
    def needed(inputs: ReplayInputs, buffers: StaticBuffers) -> bool:
        """Whether ``inputs`` differs from what the forward reads."""
        if buffers.future_tokens is not None:
            return True
        return any(
            getattr(inputs, s.name).device != buffers.device_of(s)
            for s in buffers.specs
            if s.takes_host_source
        )


def run_eager(
    parts: StepParts,
    inputs: ReplayInputs,
    raw_bs: int,
    warn_once: Callable[[], None],
    observer: StepObserver | None = None,
    *,
    same_width: bool = True,
) -> Outputs:
    """The batch is larger than every graph (or of another width): the same
    input checks, output declarations and sanitizer (no padded tails here),
    through the eager forward; ``warn_once`` is called once the inputs passed
    their checks. The sanitizer's value checks follow the buffers'
    declarations when the batch has their width (``same_width``), the decode
    step's otherwise."""
    if observer is not None:
        observer.begin(f"eager bs={raw_bs}")
    validate_step(parts.backend, inputs, raw_bs)
    check_inputs(parts.buffers, inputs, raw_bs)
    parts.pre_launch()
    warn_once()
    if observer is not None:
        specs = parts.buffers.specs if same_width else None
        observer.before_launch(parts.buffers, inputs, raw_bs, None, specs)
    # Checked above: every declared buffer is a tensor attribute of ``inputs``.
    step = cast(StepTensors, inputs)
    if _Resolved.needed(inputs, parts.buffers):
        step = _Resolved(inputs, parts.buffers)
    out = parts.forward(step)
    parts.outputs.check(out, raw_bs, any_width=True)
    if observer is not None:
        observer.after_launch(out)
    return out
