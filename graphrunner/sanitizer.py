"""The padding sanitizer: a debug mode that checks every replay.

Turn it on in an engine with ``runner = create_runner(..., sanitizer=
PaddingSanitizer.for_pools(req_pool, kv_cache))``. Around each replay it
checks, and raises :class:`PaddingViolation` naming the buffer, row and value:

* before launch: the padded tail of every static buffer holds exactly its
  declared pad value (a forgotten rule or a stale value is caught here);
  ``req_to_token`` row 0 is all zeros and no pool handed out slot 0;
* after launch: no guarded state row changed except the live rows' own
  (e.g. the KV slots in the live ``out_cache_loc``) and the sink rows, and
  ``req_to_token`` not at all (a decode step only reads it); live outputs
  are finite.

It works for every runner through the same buffer declarations. Its cost is
a copy of the guarded state and a device sync per replay; the seconds it
spent are in :attr:`PaddingSanitizer.stats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphrunner.buffers import StaticBuffers
from graphrunner.outputs import Outputs
from graphrunner.pools import KVCache, MambaStatePool, ReqToTokenPool

__all__ = ["GuardedTensor", "PaddingSanitizer", "PaddingViolation", "SanitizerStats"]


class PaddingViolation(AssertionError):
    """A padding invariant failed; the message names the buffer, row and value."""


@dataclass(frozen=True, slots=True)
class GuardedTensor:
    """State a replay may write only at the live rows' own indices.

    ``tensor`` is indexed by slot along dim 0; ``writer`` names the input field
    whose live values are the rows a step may write (e.g. ``out_cache_loc`` for
    KV), or is None for state a step only reads (``req_to_token`` in decode);
    rows ``0..sink_rows-1`` are padding sinks any padded row may write.
    """

    name: str
    tensor: torch.Tensor
    writer: str | None
    sink_rows: int = 1


@dataclass(slots=True)
class SanitizerStats:
    """Replays checked and the host seconds the checks cost."""

    replays_checked: int = 0
    seconds: float = 0.0


def _first_bad_row(bad: torch.Tensor) -> int:
    return int(torch.nonzero(bad.reshape(bad.shape[0], -1).any(1))[0])


def check_tails(buffers: StaticBuffers, raw_bs: int, bs: int) -> None:
    """Every buffer's rows ``[raw_bs:bs]`` hold exactly their pad value."""
    for spec in buffers.specs:
        value = spec.pad_value()
        if value is None:
            continue
        live, total = buffers.rows(spec, raw_bs), buffers.rows(spec, bs)
        tail = buffers.tensors[spec.name][live:total]
        bad = tail != value
        if bad.any():
            row = _first_bad_row(bad)
            raise PaddingViolation(
                f"buffer {spec.name!r} padded row {live + row} (raw_bs={raw_bs}, bs={bs}) holds "
                f"{tail[row].tolist()}; its {spec.rule.name} rule expects {value}"
            )


def check_finite(outputs: Outputs) -> None:
    items = (
        outputs.items()
        if isinstance(outputs, dict)
        else enumerate([outputs] if isinstance(outputs, torch.Tensor) else outputs)
    )
    for name, t in items:
        if t.is_floating_point() and not torch.isfinite(t).all():
            row = _first_bad_row(~torch.isfinite(t))
            raise PaddingViolation(f"output {name!r} live row {row} is not finite: {t[row]}")


class PaddingSanitizer:
    """Checks the padding invariants around every replay (see module doc).

    Args:
        guarded: state tensors whose rows only live requests may change.
        req_pool: if given, ``req_to_token`` row 0 must stay zero and slot 0
            must never be allocated.
        slot_pools: other pools that must never have handed out slot 0.
    """

    def __init__(
        self,
        guarded: Sequence[GuardedTensor] = (),
        *,
        req_pool: ReqToTokenPool | None = None,
        slot_pools: Sequence[Any] = (),
    ) -> None:
        self.guarded = list(guarded)
        self.req_pool = req_pool
        self.slot_pools = [*([req_pool] if req_pool is not None else []), *slot_pools]
        self.stats = SanitizerStats()

    @classmethod
    def for_pools(
        cls,
        req_pool: ReqToTokenPool,
        kv_cache: KVCache | None = None,
        *,
        kv_allocator: Any = None,
        mamba_pool: MambaStatePool | None = None,
        mamba_writer: str = "mamba_track_indices",
        req_to_token_writer: str | None = None,
    ) -> PaddingSanitizer:
        """Guard ``req_to_token``, every KV layer and (optionally) Mamba state.

        A decode step reads ``req_to_token`` and never writes it, so by default
        no row of it may change; a forward that assigns its live rows' slots
        itself passes ``req_to_token_writer="req_pool_indices"``.
        """
        guarded = [
            GuardedTensor("req_to_token", req_pool.req_to_token, req_to_token_writer, sink_rows=0)
        ]
        if kv_cache is not None:
            for layer in range(kv_cache.num_layers):
                k, v = kv_cache.get_kv(layer)
                # Padded rows write slot 0 only (out_cache_loc pads with 0), so
                # the rest of a paged cache's padding page must stay untouched.
                guarded += [
                    GuardedTensor(f"k_cache[{layer}]", k, "out_cache_loc", sink_rows=1),
                    GuardedTensor(f"v_cache[{layer}]", v, "out_cache_loc", sink_rows=1),
                ]
        if mamba_pool is not None:
            guarded += [
                GuardedTensor("mamba.conv_state", mamba_pool.conv_state, mamba_writer),
                GuardedTensor("mamba.ssm_state", mamba_pool.ssm_state, mamba_writer),
            ]
        pools = [p for p in (kv_allocator, mamba_pool) if p is not None]
        return cls(guarded, req_pool=req_pool, slot_pools=pools)

    def check_pools(self) -> None:
        if self.req_pool is not None and self.req_pool.req_to_token[0].any():
            row = self.req_pool.req_to_token[0]
            col = int(torch.nonzero(row)[0])
            raise PaddingViolation(
                f"req_to_token row 0 (the padding row) column {col} holds {int(row[col])}; "
                f"it must stay all zeros"
            )
        for pool in self.slot_pools:
            if pool.is_allocated(0):
                raise PaddingViolation(f"{type(pool).__name__} handed out the reserved slot 0")

    def before_launch(
        self, buffers: StaticBuffers, inputs: Any, raw_bs: int, bs: int
    ) -> _ReplayCheck:
        """Check tails and pools; snapshot guarded state for :meth:`_ReplayCheck.after_launch`."""
        start = time.perf_counter()
        check_tails(buffers, raw_bs, bs)
        self.stats.seconds += time.perf_counter() - start
        return self.snapshot(inputs)

    def snapshot(self, inputs: Any) -> _ReplayCheck:
        """Check the pools and snapshot the guarded state. The eager fallback,
        which has no padded tails, starts its check here."""
        start = time.perf_counter()
        self.check_pools()
        check = _ReplayCheck(self, inputs, [g.tensor.clone() for g in self.guarded])
        self.stats.seconds += time.perf_counter() - start
        return check


def _owner(guard: GuardedTensor) -> str:
    if guard.writer is None:
        return "state the step only reads"
    return f"neither a live row of {guard.writer!r} nor a sink"


def _changed(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Elementwise "was written": a NaN that stayed a NaN did not change."""
    if now.is_floating_point():
        return ~torch.isclose(now, before, rtol=0, atol=0, equal_nan=True)
    return now != before


@dataclass(frozen=True, slots=True)
class _ReplayCheck:
    """One replay's snapshot of the guarded state, taken before launch."""

    sanitizer: PaddingSanitizer
    inputs: Any
    snapshots: list[torch.Tensor]

    def after_launch(self, outputs: Outputs) -> None:
        resumed = time.perf_counter()
        for guard, before in zip(self.sanitizer.guarded, self.snapshots, strict=True):
            self._check_unchanged_outside_live(guard, before)
        check_finite(outputs)
        self.sanitizer.stats.replays_checked += 1
        self.sanitizer.stats.seconds += time.perf_counter() - resumed

    def _check_unchanged_outside_live(self, guard: GuardedTensor, before: torch.Tensor) -> None:
        changed = _changed(guard.tensor, before)
        changed_rows = changed.reshape(before.shape[0], -1).any(1)
        writers = None if guard.writer is None else getattr(self.inputs, guard.writer, None)
        if writers is not None:
            changed_rows[writers.to(changed_rows.device)] = False
        changed_rows[: guard.sink_rows] = False
        if changed_rows.any():
            row = int(torch.nonzero(changed_rows)[0])
            col = int(torch.nonzero(changed[row].reshape(-1))[0])
            old = before[row].reshape(-1)[col].item()
            new = guard.tensor[row].reshape(-1)[col].item()
            raise PaddingViolation(
                f"{guard.name} row {row} changed during replay (element {col}: {old!r} -> "
                f"{new!r}) but is {_owner(guard)}: a padded row, or a stray write, changed "
                f"state the step does not own"
            )
