"""The replay path, shared by every runner and mechanism: populate, replay
metadata, launch, slice to the live rows by the declared outputs; and the
eager path for a batch above every captured size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphrunner import nvtx
from graphrunner.backend import GraphBackend
from graphrunner.buffers import StaticBuffers
from graphrunner.mechanisms.base import ForwardFn, Launcher
from graphrunner.outputs import OutputLayout, Outputs
from graphrunner.populate import check_inputs, populate
from graphrunner.sanitizer import PaddingSanitizer
from graphrunner.sizes import BatchSizeError

__all__ = ["NotCapturedError", "batch_size_of", "launch_padded", "run_eager"]


class NotCapturedError(RuntimeError):
    """Replay asked for a size that was not captured (call ``capture()`` first)."""


def batch_size_of(inputs: Any) -> int:
    """The live rows of ``inputs`` (its host-side ``batch_size``), at least 1."""
    raw_bs = getattr(inputs, "batch_size", None)
    if isinstance(raw_bs, bool) or not isinstance(raw_bs, int):
        raise TypeError(
            f"{type(inputs).__name__} has no int batch_size (got {raw_bs!r}); replay takes "
            f"a graphrunner.DecodeInputs"
        )
    if raw_bs < 1:
        raise BatchSizeError(f"batch_size {raw_bs}: replay needs at least one live row")
    return raw_bs


def launch_padded(
    launcher: Launcher,
    buffers: StaticBuffers,
    backend: GraphBackend,
    layout: OutputLayout,
    sanitizer: PaddingSanitizer | None,
    inputs: Any,
    raw_bs: int,
    bs: int,
) -> tuple[Outputs, int]:
    """Populate size ``bs`` with ``raw_bs`` live rows, launch it, and return the
    live rows' outputs with the device operations populate issued."""
    with nvtx.range(f"replay bs={bs}"):
        with nvtx.range(f"populate bs={bs}"):
            ops = populate(buffers, inputs, raw_bs, bs)
        backend.init_replay_metadata(bs, raw_bs, buffers.view(bs), inputs)
        check = sanitizer.before_launch(buffers, inputs, raw_bs, bs) if sanitizer else None
        with nvtx.range(f"launch bs={bs}"):
            out = layout.live(launcher(), raw_bs)
        if check is not None:
            check.after_launch(out)
    return out, ops


def run_eager(
    forward: ForwardFn,
    buffers: StaticBuffers,
    layout: OutputLayout,
    sanitizer: PaddingSanitizer | None,
    inputs: Any,
    raw_bs: int,
    warn_once: Callable[[], None],
) -> Outputs:
    """The batch is larger than every graph: the same input checks, output
    declarations and sanitizer (no padded tails here), through the eager
    forward; ``warn_once`` is called once the inputs passed their checks."""
    check_inputs(buffers, inputs, raw_bs)
    warn_once()
    check = sanitizer.snapshot(inputs) if sanitizer else None
    with nvtx.range(f"eager bs={raw_bs}"):
        out = forward(inputs)
    layout.check(out, raw_bs)
    if check is not None:
        check.after_launch(out)
    return out
