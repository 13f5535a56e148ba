"""What a replay reaches: the graphs keyed by size and width, the batch size
of an inputs object, and the eager step for a batch above every captured size
(or of another width). The replay itself is :meth:`graphrunner.GraphRunner.replay`."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from graphrunner.core.input_check import check_host_mirrors
from graphrunner.core.observers import NO_OBSERVER, StepObserver
from graphrunner.declare.buffers import Axis, BufferView, Size, StaticBuffers, units
from graphrunner.declare.hooks import GraphBackend
from graphrunner.declare.inputs import StepInputs
from graphrunner.declare.outputs import OutputLayout, Outputs
from graphrunner.mechanisms.base import ForwardFn, Launcher
from graphrunner.sizing.sizes import BatchSizeError
from graphrunner.writers.base import check_inputs, resolve_futures

__all__ = [
    "Graph",
    "NotCapturedError",
    "StepParts",
    "batch_size_of",
    "check_host_mirrors",
    "run_eager",
]


class NotCapturedError(RuntimeError):
    """Replay asked for a size that was not captured (call ``capture()`` first)."""


def batch_size_of(inputs: StepInputs) -> int:
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


def validate_step(backend: GraphBackend, inputs: StepInputs, raw_bs: Size) -> None:
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


class Graph(NamedTuple):
    """One capture as a replay reaches it (looked up by raw batch size)."""

    bs: Size  # the captured size (a token batch: tokens and requests)
    launcher: Launcher
    view: BufferView  # the buffers' rows for ``bs`` requests (what it reads)


def live_view(inputs: StepInputs, buffers: StaticBuffers, raw_bs: Size) -> BufferView:
    """What the eager forward reads: the live rows of ``inputs``'s declared
    fields by name, host-produced ones moved to the buffers' device and
    future references resolved (the eager path does not go through populate)."""
    tensors = {}
    for spec in buffers.specs:
        given: torch.Tensor = getattr(inputs, spec.name)
        value = given.to(buffers.device_of(spec), non_blocking=True)  # given, if there
        if spec.future:
            value = value.clone() if value is given else value
            resolve_futures(value, buffers.future_tokens)
        tensors[spec.name] = value
    return BufferView(units(Axis.REQUEST, raw_bs), tensors)


def run_eager(
    parts: StepParts,
    inputs: StepInputs,
    raw_bs: Size,
    warn_once: Callable[[], None],
    observer: StepObserver = NO_OBSERVER,
    *,
    same_width: bool = True,
) -> Outputs:
    """The batch is larger than every graph (or of another width): the same
    input checks, output declarations and sanitizer (no padded tails here),
    through the eager forward; ``warn_once`` is called once the inputs passed
    their checks. The sanitizer's value checks follow the buffers'
    declarations when the batch has their width (``same_width``), the decode
    step's otherwise."""
    observer.begin("eager", raw_bs)
    validate_step(parts.backend, inputs, raw_bs)
    check_inputs(parts.buffers, inputs, raw_bs)
    parts.pre_launch()
    warn_once()
    specs = parts.buffers.specs if same_width else None
    observer.before_launch(parts.buffers, inputs, raw_bs, None, specs)
    out = parts.forward(live_view(inputs, parts.buffers, raw_bs))
    parts.outputs.check(out, raw_bs, any_width=True)
    observer.after_launch(out)
    return out
