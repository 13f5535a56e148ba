"""The padding sanitizer: a debug mode that checks every replay.

Turn it on in an engine with ``runner = create_runner(..., sanitizer=
PaddingSanitizer.for_pools(req_pool, kv_cache))``. Around each replay it
checks, and raises :class:`PaddingViolation` naming the buffer, row and value:

* before launch: the padded tail of every static buffer holds exactly its
  declared pad value (a forgotten rule or a stale value is caught here);
  ``req_to_token`` row 0 is all zeros and no pool handed out slot 0; every
  live index value is one the step may use (:meth:`PaddingSanitizer.
  check_live_values`: allocated, non-zero, unique request rows and KV slots,
  each slot the one its request recorded, ``positions == seq_lens - 1``,
  device values equal to their host mirrors), and every index that lets a
  step write guarded state lies in ``[0, rows)``: a negative one would wrap
  onto the last rows, another request's;
* after launch: no guarded state row changed except the live rows' own
  (e.g. the KV slots in the live ``out_cache_loc``) and the sink rows, and
  ``req_to_token`` not at all (a decode step only reads it); live outputs
  are finite.

It works for every runner through the same buffer declarations. Its cost is
a copy of the guarded state and device reads per replay; the seconds it
spent are in :attr:`PaddingSanitizer.stats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.declare.buffers import BufferSpec, Size, StaticBuffers
from graphrunner.declare.decode import OUT_CACHE_LOC
from graphrunner.declare.outputs import Outputs
from graphrunner.pools import KVCache, MambaStatePool, ReqToTokenPool, TokenToKVPoolAllocator
from graphrunner.sanitizer.checks import (
    GuardedTensor,
    PaddingViolation,
    SlotOwner,
    check_finite,
    check_tails,
    check_writers,
)
from graphrunner.sanitizer.values import DEFAULT_VALUE_SPECS, ValueContext, check_declared_values

if TYPE_CHECKING:
    from graphrunner.sanitizer.shared import SharedPages

__all__ = [
    "GuardedTensor",
    "PaddingSanitizer",
    "PaddingViolation",
    "ReplayCheck",
    "SanitizerStats",
    "SlotOwner",
    "check_finite",
    "check_tails",
]


@dataclass(slots=True)
class SanitizerStats:
    """Replays checked and the host seconds the checks cost."""

    replays_checked: int = 0
    seconds: float = 0.0


class PaddingSanitizer:
    """Checks the padding invariants around every replay (see module doc).

    Args:
        guarded: state tensors whose rows only live requests may change.
        req_pool: if given, ``req_to_token`` row 0 must stay zero and slot 0
            must never be allocated; live ``req_pool_indices`` must be its
            allocated rows and live ``out_cache_loc`` the slots they recorded.
        kv_allocator: if given, live ``out_cache_loc`` must be its allocated
            slots (default: the first :class:`TokenToKVPoolAllocator` in
            ``slot_pools``).
        slot_pools: other pools that must never have handed out slot 0.
        vocab_size: if given, live token ids (a buffer declaring
            ``indexes=Index.TOKEN``, e.g. ``input_ids``) must be in ``0..vocab_size - 1``.
        shared_pages: a KV pool whose pages requests share by prefix
            (default: ``kv_allocator`` if it is a :class:`CachedKVAllocator`):
            its bookkeeping must be consistent, every page a live request
            maps held, and no live KV write may land in a page held by two
            requests or indexed (:mod:`graphrunner.sanitizer.shared`).

    Which live values are checked, and how, comes from what each buffer
    declares it indexes (:class:`~graphrunner.declare.buffers.Index`): the
    replaying runner's buffers before a graph launch, the decode step's where
    no buffers are given (an eager fallback, a bare :meth:`snapshot`).
    """

    def __init__(
        self,
        guarded: Sequence[GuardedTensor] = (),
        *,
        req_pool: ReqToTokenPool | None = None,
        kv_allocator: SlotOwner | None = None,
        slot_pools: Sequence[Any] = (),
        vocab_size: int | None = None,
        check_reads: bool = True,
        shared_pages: SharedPages | None = None,
    ) -> None:
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1
        ):
            raise ValueError(f"vocab_size={vocab_size!r}; expected an int >= 1 or None")
        self.vocab_size = vocab_size
        #: Relaunch each padded replay with the sinks and padded rows changed,
        #: and compare (:mod:`graphrunner.sanitizer.reads`); about twice the cost.
        self.check_reads = check_reads
        # The declarations the live-value checks of the current step follow.
        self._value_specs: Sequence[BufferSpec] = DEFAULT_VALUE_SPECS
        self.guarded = list(guarded)
        self.req_pool = req_pool
        if kv_allocator is None:
            kv_pools = (p for p in slot_pools if isinstance(p, TokenToKVPoolAllocator))
            kv_allocator = next(kv_pools, None)
        self.kv_allocator = kv_allocator
        self.shared_pages = shared_pages if shared_pages is not None else _shared(kv_allocator)
        owners = [p for p in (req_pool, kv_allocator) if p is not None]
        self.slot_pools = [*owners, *(p for p in slot_pools if p is not kv_allocator)]
        self.stats = SanitizerStats()

    @classmethod
    def for_pools(
        cls,
        req_pool: ReqToTokenPool,
        kv_cache: KVCache | None = None,
        *,
        kv_allocator: SlotOwner | None = None,
        mamba_pool: MambaStatePool | None = None,
        mamba_writer: str = "mamba_track_indices",
        req_to_token_writer: str | None = None,
        vocab_size: int | None = None,
        guard: Sequence[GuardedTensor] = (),
        shared_pages: SharedPages | None = None,
    ) -> PaddingSanitizer:
        """Guard ``req_to_token``, every KV layer and (optionally) Mamba state.

        A decode step reads ``req_to_token`` and never writes it, so by default
        no row of it may change; a forward that assigns its live rows' slots
        itself passes ``req_to_token_writer="req_pool_indices"``. ``vocab_size``
        bounds live token ids (see the class). ``guard``: state of one's own
        guarded too (a :class:`GuardedTensor` each). ``shared_pages``: see
        the class (a :class:`CachedKVAllocator` given as ``kv_allocator`` is
        checked by default).
        """
        guarded = [
            GuardedTensor(
                "req_to_token",
                req_pool.req_to_token,
                req_to_token_writer,
                sink_rows=0,
                unit="request row",
            )
        ]
        if kv_cache is not None:
            for layer in range(kv_cache.num_layers):
                k, v = kv_cache.get_kv(layer)
                # Padded rows write slot 0 only (out_cache_loc pads with 0), so
                # the rest of a paged cache's padding page must stay untouched.
                guarded += [
                    GuardedTensor(f"k_cache[{layer}]", k, OUT_CACHE_LOC, sink_rows=1),
                    GuardedTensor(f"v_cache[{layer}]", v, OUT_CACHE_LOC, sink_rows=1),
                ]
        if mamba_pool is not None:
            # No sink row: padded rows discard their update (mamba_track_mask),
            # so even slot 0 must stay bit-identical.
            guarded += [
                GuardedTensor(
                    "mamba.conv_state", mamba_pool.conv_state, mamba_writer, 0, "Mamba slot"
                ),
                GuardedTensor(
                    "mamba.ssm_state", mamba_pool.ssm_state, mamba_writer, 0, "Mamba slot"
                ),
            ]
        guarded += list(guard)
        pools = [mamba_pool] if mamba_pool is not None else []
        return cls(
            guarded,
            req_pool=req_pool,
            kv_allocator=kv_allocator,
            slot_pools=pools,
            vocab_size=vocab_size,
            shared_pages=shared_pages,
        )

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
        if self.shared_pages is not None:
            from graphrunner.sanitizer.shared import check_cache_consistency  # on first use

            check_cache_consistency(self.shared_pages)

    def check_live_values(self, inputs: object, raw_bs: Size) -> None:
        """Every live index value is one the step may use; reads the device.

        The checks follow the buffers' index declarations (see the class);
        each runs only when ``inputs`` has the fields it needs, in their
        buffers' layout (``raw_bs * r`` rows), and the pool it checks against.
        """
        ctx = ValueContext(self.req_pool, self.kv_allocator, self.vocab_size, self.shared_pages)
        check_declared_values(self._value_specs, inputs, raw_bs, ctx)

    def before_launch(
        self, buffers: StaticBuffers, inputs: object, raw_bs: Size, bs: Size
    ) -> ReplayCheck:
        """Check tails, then everything :meth:`snapshot` checks; snapshot guarded
        state for :meth:`ReplayCheck.after_launch`."""
        start = time.perf_counter()
        check_tails(buffers, raw_bs, bs)
        self.stats.seconds += time.perf_counter() - start
        return self.snapshot(inputs, raw_bs, specs=buffers.specs)

    def snapshot(
        self,
        inputs: object,
        raw_bs: Size | None = None,
        *,
        specs: Sequence[BufferSpec] | None = None,
    ) -> ReplayCheck:
        """Check the pools, the live index values and the writer indices, and
        snapshot the guarded state. The eager fallback, which has no padded
        tails, starts its check here. ``raw_bs`` defaults to ``inputs.batch_size``;
        without either, the live values are not checked (the writers still are).
        ``specs``: the buffer declarations the value checks follow (default
        the decode step's)."""
        start = time.perf_counter()
        self.check_pools()
        raw_bs = _batch_size(inputs) if raw_bs is None else raw_bs
        if raw_bs is not None:
            self._value_specs = DEFAULT_VALUE_SPECS if specs is None else specs
            try:
                self.check_live_values(inputs, raw_bs)
            finally:
                self._value_specs = DEFAULT_VALUE_SPECS
        for guard in self.guarded:
            check_writers(guard, inputs)
        check = ReplayCheck(self, inputs, [g.tensor.clone() for g in self.guarded])
        self.stats.seconds += time.perf_counter() - start
        return check


def _shared(kv_allocator: SlotOwner | None) -> SharedPages | None:
    """``kv_allocator`` if it shares pages by prefix, else None."""
    if kv_allocator is None:
        return None
    from graphrunner.pools import CachedKVAllocator  # on first use: a sanitizer is a debug mode

    return kv_allocator if isinstance(kv_allocator, CachedKVAllocator) else None


def _batch_size(inputs: object) -> int | None:
    raw_bs = getattr(inputs, "batch_size", None)
    return raw_bs if isinstance(raw_bs, int) and not isinstance(raw_bs, bool) else None


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
class ReplayCheck:
    """One replay's snapshot of the guarded state, taken before launch."""

    sanitizer: PaddingSanitizer
    inputs: object
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
        # Only validated indices exempt a row: a -1 would exempt the last one.
        writers = check_writers(guard, self.inputs)
        if writers is not None:
            changed_rows[writers.to(changed_rows.device)] = False
        changed_rows[: guard.sink_rows] = False
        if changed_rows.any():
            row = int(torch.nonzero(changed_rows)[0])
            col = int(torch.nonzero(changed[row].reshape(-1))[0])
            old = before[row].reshape(-1)[col].item()
            new = guard.tensor[row].reshape(-1)[col].item()
            raise PaddingViolation(
                f"{guard.name} {guard.row_name} {row} changed during replay (element {col}: "
                f"{old!r} -> {new!r}) but is {_owner(guard)}: a padded row, or a stray "
                "write, changed state the step does not own"
            )
