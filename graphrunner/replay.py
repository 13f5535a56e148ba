"""The replay path, shared by every runner: choose the size, populate, launch,
slice to the live rows."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

from graphrunner import nvtx
from graphrunner.populate import check_inputs, populate
from graphrunner.runner import Outputs
from graphrunner.sizes import BatchSizeError

if TYPE_CHECKING:
    from graphrunner.runner import GraphRunner

__all__ = ["NotCapturedError", "live_rows", "replay"]

logger = logging.getLogger("graphrunner")


class NotCapturedError(RuntimeError):
    """Replay asked for a size that was not captured (call ``capture()`` first)."""


def _live(t: torch.Tensor, raw_bs: int, bs: int) -> torch.Tensor:
    # Per-token outputs have bs * k rows; keep the first raw_bs * k.
    return t[: t.shape[0] // bs * raw_bs]


def live_rows(out: Outputs, raw_bs: int, bs: int) -> Outputs:
    """Views of ``out`` (computed for ``bs`` rows) restricted to the first ``raw_bs``."""
    if isinstance(out, torch.Tensor):
        return _live(out, raw_bs, bs)
    if isinstance(out, dict):
        return {k: _live(v, raw_bs, bs) for k, v in out.items()}
    return tuple(_live(v, raw_bs, bs) for v in out)


# Frames between the caller's ``runner.replay(...)`` and ``warnings.warn``:
# GraphRunner.replay -> replay -> _eager_fallback -> _warn_fallback_once.
_CALLER_STACKLEVEL = 5


def _warn_fallback_once(runner: GraphRunner, raw_bs: int) -> None:
    if runner._warned_fallback:
        return
    runner._warned_fallback = True
    msg = (
        f"batch size {raw_bs} is above the largest captured size {runner.max_bs}; "
        f"running it eagerly (counted in runner.stats.eager_fallbacks, warned once)"
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=_CALLER_STACKLEVEL)
    logger.warning(msg)


def _eager_fallback(runner: GraphRunner, inputs: Any, raw_bs: int) -> Outputs:
    """The batch is larger than every graph: the same inputs, checks and
    sanitizer (no padded tails here), through the eager forward."""
    check_inputs(runner.buffers, inputs, raw_bs)
    _warn_fallback_once(runner, raw_bs)
    runner.stats.eager_fallbacks += 1
    runner.stats.live_rows += raw_bs
    check = runner.sanitizer.snapshot(inputs) if runner.sanitizer else None
    with nvtx.range(f"eager bs={raw_bs}"):
        out = runner.forward(inputs)
    if check is not None:
        check.after_launch(out)
    return out


def replay(runner: GraphRunner, inputs: Any) -> Outputs:
    """See :meth:`graphrunner.runner.GraphRunner.replay`."""
    raw_bs = getattr(inputs, "batch_size", None)
    if isinstance(raw_bs, bool) or not isinstance(raw_bs, int):
        raise TypeError(
            f"{type(inputs).__name__} has no int batch_size (got {raw_bs!r}); replay takes "
            f"a graphrunner.DecodeInputs"
        )
    if raw_bs < 1:
        raise BatchSizeError(f"batch_size {raw_bs}: replay needs at least one live row")
    with torch.no_grad():
        if raw_bs > runner.max_bs:
            return _eager_fallback(runner, inputs, raw_bs)
        return _replay_graph(runner, inputs, raw_bs)


def _replay_graph(runner: GraphRunner, inputs: Any, raw_bs: int) -> Outputs:
    bs = runner.graph_size_for(raw_bs)
    launcher = runner._launchers.get(bs)
    if launcher is None:
        raise NotCapturedError(f"size {bs} (for batch {raw_bs}) is not captured; call capture()")
    with nvtx.range(f"replay bs={bs}"):
        with nvtx.range(f"populate bs={bs}"):
            ops = populate(runner.buffers, inputs, raw_bs, bs)
        runner.backend.init_replay_metadata(bs, raw_bs, runner.buffers.view(bs), inputs)
        check = (
            runner.sanitizer.before_launch(runner, inputs, raw_bs, bs) if runner.sanitizer else None
        )
        with nvtx.range(f"launch bs={bs}"):
            out = live_rows(launcher(), raw_bs, bs)
        if check is not None:
            check.after_launch(out)
    stats = runner.stats
    stats.replays += 1
    stats.live_rows += raw_bs
    stats.padded_rows += bs - raw_bs
    stats.populate_ops += ops
    stats.last_populate_ops = ops
    return out
