"""The runner's pre-launch step: state ops the scheduler recorded (Mamba
clears and copies) run on the forward's stream, before the forward, once.

The scheduler never touches state tensors: it records ops on a pool
(:meth:`graphrunner.pools.MambaStatePool.record_clear` / ``record_copy``).
A :class:`~graphrunner.GraphRunner` built with ``state_ops=pool`` drains that
queue in every step, graph or eager, once the step's inputs passed their
checks and before anything is written for it, on the current stream (the one
the launch runs on), so no op races the forward that reads the state. A
refused step runs none of them: they stay queued for the next step. Draining
is what makes it exactly once: a second runner over the same pool (a
speculative draft pass) finds the queue empty.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["StateOps", "run_state_ops"]


@runtime_checkable
class StateOps(Protocol):
    """A queue of recorded state ops (a :class:`~graphrunner.pools.MambaStatePool`
    or a hybrid request pool)."""

    @property
    def num_pending(self) -> int: ...

    def run_pending(self, stream: torch.cuda.Stream | None = None) -> int: ...


def check_state_ops(state_ops: object) -> StateOps | None:
    """``state_ops`` as a :class:`StateOps`, or None; a ``TypeError`` naming it else."""
    if state_ops is None or isinstance(state_ops, StateOps):
        return state_ops
    raise TypeError(
        f"state_ops={state_ops!r}; expected None or a pool with num_pending and "
        f"run_pending(stream) (a MambaStatePool or HybridReqToTokenPool)"
    )


def run_state_ops(state_ops: StateOps | None) -> int:
    """Run every recorded op, in order, on the current stream; returns how many ran.

    The current stream is the one the launch that follows runs on (a CUDA
    graph replays on it; eager and inductor programs run on it), so the ops
    are ordered before the forward without a host sync.
    """
    if state_ops is None or not state_ops.num_pending:
        return 0
    return state_ops.run_pending(None)
