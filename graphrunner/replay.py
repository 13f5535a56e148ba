"""The replay path, shared by every runner: choose the size, populate, launch,
slice to the live rows."""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

from graphrunner import nvtx
from graphrunner.populate import populate
from graphrunner.runner import Outputs

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


def _eager_fallback(runner: GraphRunner, inputs: Any, raw_bs: int) -> Outputs:
    runner.stats.eager_fallbacks += 1
    if not runner._warned_fallback:
        runner._warned_fallback = True
        msg = (
            f"batch size {raw_bs} is outside the captured sizes 1..{runner.max_bs}; "
            f"running it eagerly (counted in runner.stats.eager_fallbacks, warned once)"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        logger.warning(msg)
    with nvtx.range(f"eager bs={raw_bs}"):
        return runner.forward(inputs)


def replay(runner: GraphRunner, inputs: Any) -> Outputs:
    """See :meth:`graphrunner.runner.GraphRunner.replay`."""
    raw_bs = getattr(inputs, "batch_size", None)
    if not isinstance(raw_bs, int):
        raise TypeError(
            f"{type(inputs).__name__} has no int batch_size (got {raw_bs!r}); replay takes "
            f"a graphrunner.DecodeInputs"
        )
    if not 1 <= raw_bs <= runner.max_bs:
        return _eager_fallback(runner, inputs, raw_bs)
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
        with nvtx.range(f"launch bs={bs}"), torch.no_grad():
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
