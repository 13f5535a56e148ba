"""Checks that the ranks of a tensor-parallel model agree before they would
wait on each other: the same capture sizes before capture, and, under the
padding sanitizer, the same raw and padded size on every replay; and the one
decision rank 0 makes for all, how many arrived requests each engine step admits.

Every rank runs the same engine on the same trace (SPMD), so a disagreement
is a bug; these checks turn it into an error naming each rank's value where
it would otherwise be a collective that never completes (or times out).
"""

from __future__ import annotations

from collections.abc import Callable

from graphrunner import GraphRunner
from graphrunner_ref.model.parallel import SINGLE, TensorParallel

__all__ = [
    "agree_on_sizes",
    "bundle_tp",
    "rank0_admits",
    "refuse_sharded",
    "replay_size_check",
]


def bundle_tp(bundle: object) -> TensorParallel:
    """The tensor-parallel place of ``bundle``'s model (alone for a model without one)."""
    tp = getattr(getattr(bundle, "model", None), "tp", SINGLE)
    return tp if isinstance(tp, TensorParallel) else SINGLE


def refuse_sharded(bundle: object, what: str) -> None:
    """``ValueError`` naming ``what`` when ``bundle``'s model is a tensor-parallel shard."""
    tp = bundle_tp(bundle)
    if tp.world > 1:
        raise ValueError(f"{what}: a tensor-parallel model (tp.world={tp.world}); expected 1")


def agree_on_sizes(bundle: object, runner: GraphRunner) -> GraphRunner:
    """``runner``, once every rank's runner has the same capture sizes
    (``ValueError`` naming each rank's list otherwise)."""
    bundle_tp(bundle).agree("capture sizes", runner.capture_sizes)
    return runner


def replay_size_check(bundle: object, runner: GraphRunner) -> Callable[[int], None] | None:
    """For a sharded model whose runner has a padding sanitizer: a check to
    call with each replay's raw batch size, raising ``ValueError`` naming each
    rank's raw and padded size when they differ. None otherwise (no cost)."""
    tp = bundle_tp(bundle)
    if tp.world == 1 or runner.sanitizer is None:
        return None

    def check(raw_bs: int) -> None:
        try:
            padded = runner.graph_size_for(raw_bs)
        except ValueError:  # no captured size fits: -1, agreed on before the runner refuses
            padded = -1
        tp.agree("replay sizes [raw, padded]", [raw_bs, padded])

    return check


def rank0_admits(bundle: object) -> Callable[[int], int] | None:
    """For a sharded model: the engine's admission hook (``Engine.admission``),
    ``fits -> admitted``: every rank admits rank 0's count of the arrived
    requests that fit, so every rank's batch (and padded size) is rank 0's;
    ``ValueError`` naming both counts when a rank fits fewer. None alone (no cost)."""
    tp = bundle_tp(bundle)
    if tp.world == 1:
        return None

    def admitted(fits: int) -> int:
        (count,) = tp.broadcast([fits])
        if count > fits:
            raise ValueError(
                f"admission: rank 0 admits {count} requests, rank {tp.rank} fits {fits}; "
                "expected every rank's pools to fit rank 0's batch"
            )
        return count

    return admitted
