"""The replay path, shared by every runner and mechanism: populate, replay
metadata, launch, slice to the live rows by the declared outputs; and the
eager path for a batch above every captured size."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, cast

import torch

from graphrunner.core.input_check import InputGate, check_host_mirrors
from graphrunner.declare.buffers import BufferView, StaticBuffers
from graphrunner.declare.hooks import GraphBackend
from graphrunner.declare.outputs import OutputLayout, Outputs, poison_outputs
from graphrunner.declare.step_inputs import ReplayInputs, StepTensors
from graphrunner.mechanisms.base import ForwardFn, Launcher, PopulateWriter
from graphrunner.sanitizer.padding import PaddingSanitizer
from graphrunner.sizing.sizes import BatchSizeError
from graphrunner.util import nvtx
from graphrunner.writers.base import check_inputs, resolve_futures

__all__ = [
    "Graph",
    "GraphKey",
    "NotCapturedError",
    "StepParts",
    "batch_size_of",
    "check_host_mirrors",
    "launch_padded",
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


def _poison_held(held: Outputs | None, buffers: StaticBuffers, inputs: ReplayInputs) -> None:
    """Poison the previous step's outputs, sparing what this step still reads."""
    if held is not None:
        fields = [getattr(inputs, s.name, None) for s in buffers.specs]
        spare = [*buffers.tensors.values(), *(t for t in fields if isinstance(t, torch.Tensor))]
        poison_outputs(held, spare)


class StepParts(Protocol):
    """What a step reads of its runner (a :class:`~graphrunner.GraphRunner`)."""

    forward: ForwardFn
    buffers: StaticBuffers
    backend: GraphBackend
    outputs: OutputLayout
    sanitizer: PaddingSanitizer | None
    input_gate: InputGate
    #: Who writes the buffers at replay (the mechanism's writer, or the torch one).
    writer: PopulateWriter

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

    @property
    def bs(self) -> int:
        return self.key.bs


def launch_padded(
    parts: StepParts,
    graph: Graph,
    inputs: ReplayInputs,
    raw_bs: int,
    held: Outputs | None = None,
) -> tuple[Outputs, int]:
    """Populate ``graph``'s size with ``raw_bs`` live rows, launch it, and
    return the live rows' outputs with the device operations populate issued.
    ``held``, the previous step's outputs under a sanitizer, is poisoned
    before launch.

    Without a sanitizer this is the lean path: the inputs' checks cost O(1)
    when they were validated where they were made or on an earlier replay
    (:mod:`graphrunner.core.input_check`), then one staged write by the
    runner's writer, the backend's metadata, the launch, the slice. Under a
    sanitizer every replay checks everything; while a profiler or an NVTX tool
    watches, the same steps run as named ranges (replay, populate, launch)."""
    if parts.sanitizer is None and held is None and not nvtx.active():
        bs = graph.bs
        sources = parts.input_gate.sources(inputs, raw_bs, parts.backend)
        parts.pre_launch()
        ops = parts.writer.write(sources, raw_bs, bs)
        parts.backend.init_replay_metadata(bs, raw_bs, graph.view, inputs)
        return parts.outputs.live(graph.launcher(), raw_bs), ops
    return _launch_observed(parts, graph, inputs, raw_bs, held)


def _launch_observed(
    parts: StepParts,
    graph: Graph,
    inputs: ReplayInputs,
    raw_bs: int,
    held: Outputs | None,
) -> tuple[Outputs, int]:
    # Under a sanitizer (full checks, poisoned held outputs) or a profiler (ranges).
    buffers, backend, sanitizer = parts.buffers, parts.backend, parts.sanitizer
    bs, launcher = graph.bs, graph.launcher
    with nvtx.range(f"replay bs={bs}"):
        sources = parts.input_gate.sources(inputs, raw_bs, backend, full=sanitizer is not None)
        parts.pre_launch()
        with nvtx.range(f"populate bs={bs}"):
            ops = parts.writer.write(sources, raw_bs, bs)
        backend.init_replay_metadata(bs, raw_bs, buffers.view(bs), inputs)
        check = sanitizer.before_launch(buffers, inputs, raw_bs, bs) if sanitizer else None
        _poison_held(held, buffers, inputs)
        with nvtx.range(f"launch bs={bs}"):
            out = parts.outputs.live(launcher(), raw_bs)
        if check is not None:
            check.after_launch(out)
    return out, ops


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
    held: Outputs | None = None,
    *,
    same_width: bool = True,
) -> Outputs:
    """The batch is larger than every graph (or of another width): the same
    input checks, output declarations and sanitizer (no padded tails here),
    through the eager forward; ``warn_once`` is called once the inputs passed
    their checks. The sanitizer's value checks follow the buffers'
    declarations when the batch has their width (``same_width``), the decode
    step's otherwise."""
    validate_step(parts.backend, inputs, raw_bs)
    check_inputs(parts.buffers, inputs, raw_bs)
    parts.pre_launch()
    warn_once()
    specs = parts.buffers.specs if same_width else None
    check = parts.sanitizer.snapshot(inputs, raw_bs, specs=specs) if parts.sanitizer else None
    _poison_held(held, parts.buffers, inputs)
    # Checked above: every declared buffer is a tensor attribute of ``inputs``.
    step = cast(StepTensors, inputs)
    if _Resolved.needed(inputs, parts.buffers):
        step = _Resolved(inputs, parts.buffers)
    with nvtx.range(f"eager bs={raw_bs}"):
        out = parts.forward(step)
    parts.outputs.check(out, raw_bs, any_width=True)
    if check is not None:
        check.after_launch(out)
    return out
