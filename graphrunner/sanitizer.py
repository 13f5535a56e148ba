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
from typing import Any, Protocol

import torch

from graphrunner.buffers import StaticBuffers
from graphrunner.decode import DECODE_HOST_MIRRORS
from graphrunner.outputs import Outputs
from graphrunner.pools import KVCache, MambaStatePool, ReqToTokenPool, TokenToKVPoolAllocator

__all__ = [
    "GuardedTensor",
    "PaddingSanitizer",
    "PaddingViolation",
    "SanitizerStats",
    "SlotOwner",
]


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


#: The fields whose live values the sanitizer checks, host mirrors included.
_VALUE_FIELDS = (
    "req_pool_indices",
    "seq_lens",
    "positions",
    "out_cache_loc",
    *DECODE_HOST_MIRRORS.values(),
)


class SlotOwner(Protocol):
    """A pool that can say whether it handed out a slot (every library pool can)."""

    def is_allocated(self, slot: int) -> bool: ...


def _violation(field: str, row: int, value: int, expected: str) -> PaddingViolation:
    return PaddingViolation(f"{field} live row {row} = {value}: expected {expected}")


def _is_index_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())


def _live_ints(inputs: Any, name: str, raw_bs: int) -> list[int] | None:
    """Field ``name``'s live values as host ints (a device read: debug mode
    only), or None when ``inputs`` has no 1-D integer ``name`` of ``raw_bs``
    rows: another phase's inputs (several rows per request), whose checks
    this sanitizer does not know, so they are skipped rather than guessed."""
    t = getattr(inputs, name, None)
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != raw_bs:
        return None
    return [int(v) for v in t.tolist()] if _is_index_dtype(t) else None


def _check_once(field: str, values: list[int], what: str) -> None:
    first_row: dict[int, int] = {}
    for i, v in enumerate(values):
        if v in first_row:
            raise _violation(field, i, v, f"each {what} once (live row {first_row[v]} has it too)")
        first_row[v] = i


def _check_mirror(field: str, device: list[int] | None, host: list[int] | None) -> None:
    """The device values the graph reads equal the host mirror the scheduler
    planned from: a stale device tensor would read other columns silently."""
    if device is None or host is None:
        return
    for i, (d, h) in enumerate(zip(device, host, strict=True)):
        if d != h:
            mirror = DECODE_HOST_MIRRORS[field]
            raise _violation(field, i, d, f"{h}, its host mirror {mirror}[{i}]")


def check_req_rows(req_pool: ReqToTokenPool, rows: list[int]) -> None:
    """Each live row is an allocated request row other than the padding row 0, once."""
    last = req_pool.req_to_token.shape[0] - 1
    for i, r in enumerate(rows):
        if r == 0:
            raise _violation("req_pool_indices", i, r, "a live request row, not the padding row 0")
        if not 1 <= r <= last:
            raise _violation("req_pool_indices", i, r, f"a request row in 1..{last}")
        if not req_pool.is_allocated(r):
            raise _violation(
                "req_pool_indices", i, r, "an allocated request row (it is free: finished?)"
            )
    _check_once("req_pool_indices", rows, "request row")


def check_lengths(seq_lens: list[int], positions: list[int] | None, width: int | None) -> None:
    """``seq_lens`` in ``1..width`` (the new token counted) and ``positions ==
    seq_lens - 1``, so the new token's ``req_to_token`` column is in range."""
    top = f"..{width}" if width is not None else " or more"
    for i, n in enumerate(seq_lens):
        if n < 1 or (width is not None and n > width):
            raise _violation("seq_lens", i, n, f"1{top} (the req_to_token width)")
    for i, (n, p) in enumerate(zip(seq_lens, positions or [], strict=False)):
        if p != n - 1:
            raise _violation("positions", i, p, f"seq_lens - 1 = {n - 1}")


def check_kv_slots(kv_allocator: SlotOwner | None, locs: list[int]) -> None:
    """Each live slot is an allocated KV slot other than the padding slot 0, once."""
    for i, s in enumerate(locs):
        if s == 0:
            raise _violation("out_cache_loc", i, s, "a live KV slot, not the padding slot 0")
        if kv_allocator is not None and not kv_allocator.is_allocated(s):
            raise _violation(
                "out_cache_loc", i, s, "an allocated KV slot (it is free or out of range)"
            )
    _check_once("out_cache_loc", locs, "KV slot")


def check_kv_owner(
    req_to_token: torch.Tensor, rows: list[int], positions: list[int], locs: list[int]
) -> None:
    """Each live slot is the one its request recorded for the new token
    (``prepare_decode`` writes it before the step, paged or not): any other
    slot is another request's KV, which the step would overwrite."""
    width = req_to_token.shape[1]
    for i, p in enumerate(positions):
        if not 0 <= p < width:  # reached when seq_lens is absent and did not bound it
            raise _violation("positions", i, p, f"a req_to_token column in 0..{width - 1}")
    device = req_to_token.device
    at_rows, at_cols = (
        torch.tensor(x, dtype=torch.int64, device=device) for x in (rows, positions)
    )
    recorded = req_to_token[at_rows, at_cols].tolist()
    for i, (r, p, s, rec) in enumerate(zip(rows, positions, locs, recorded, strict=True)):
        if s != rec:
            raise _violation(
                "out_cache_loc", i, s, f"req_to_token[{r}, {p}] = {rec}, the slot its request owns"
            )


def check_writers(guard: GuardedTensor, inputs: Any) -> torch.Tensor | None:
    """The indices ``guard`` lets this step write, flattened, each checked to be in
    ``[0, rows)``: a negative one wraps onto the last rows (another request's),
    so it may neither write nor exempt a row from the state check."""
    writers = None if guard.writer is None else getattr(inputs, guard.writer, None)
    if guard.writer is None or not isinstance(writers, torch.Tensor):
        return None
    flat = writers.reshape(-1)
    if not _is_index_dtype(flat):
        raise PaddingViolation(
            f"{guard.writer} has dtype {flat.dtype}: expected integer rows of {guard.name}"
        )
    rows = guard.tensor.shape[0]
    bad = (flat < 0) | (flat >= rows)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise _violation(guard.writer, i, int(flat[i]), f"a row of {guard.name} in 0..{rows - 1}")
    return flat


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
    """

    def __init__(
        self,
        guarded: Sequence[GuardedTensor] = (),
        *,
        req_pool: ReqToTokenPool | None = None,
        kv_allocator: SlotOwner | None = None,
        slot_pools: Sequence[Any] = (),
    ) -> None:
        self.guarded = list(guarded)
        self.req_pool = req_pool
        if kv_allocator is None:
            kv_pools = (p for p in slot_pools if isinstance(p, TokenToKVPoolAllocator))
            kv_allocator = next(kv_pools, None)
        self.kv_allocator = kv_allocator
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
        pools = [mamba_pool] if mamba_pool is not None else []
        return cls(guarded, req_pool=req_pool, kv_allocator=kv_allocator, slot_pools=pools)

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

    def check_live_values(self, inputs: Any, raw_bs: int) -> None:
        """Every live index value is one the step may use; reads the device.

        A check runs only when ``inputs`` has the fields it needs, each 1-D of
        ``raw_bs`` rows (see :func:`_live_ints`), and the pool it checks against.
        """
        live = {name: _live_ints(inputs, name, raw_bs) for name in _VALUE_FIELDS}
        rows = live["req_pool_indices"]
        if rows is not None and self.req_pool is not None:
            check_req_rows(self.req_pool, rows)
        _check_mirror("req_pool_indices", rows, live[DECODE_HOST_MIRRORS["req_pool_indices"]])
        self._check_positions(live)
        self._check_out_cache_loc(live)

    def _check_positions(self, live: dict[str, list[int] | None]) -> None:
        seq_lens = live["seq_lens"]
        _check_mirror("seq_lens", seq_lens, live[DECODE_HOST_MIRRORS["seq_lens"]])
        if seq_lens is not None:
            width = None if self.req_pool is None else self.req_pool.req_to_token.shape[1]
            check_lengths(seq_lens, live["positions"], width)

    def _check_out_cache_loc(self, live: dict[str, list[int] | None]) -> None:
        rows, positions, locs = live["req_pool_indices"], live["positions"], live["out_cache_loc"]
        if locs is None:
            return
        check_kv_slots(self.kv_allocator, locs)
        if self.req_pool is not None and rows is not None and positions is not None:
            check_kv_owner(self.req_pool.req_to_token, rows, positions, locs)

    def before_launch(
        self, buffers: StaticBuffers, inputs: Any, raw_bs: int, bs: int
    ) -> _ReplayCheck:
        """Check tails, then everything :meth:`snapshot` checks; snapshot guarded
        state for :meth:`_ReplayCheck.after_launch`."""
        start = time.perf_counter()
        check_tails(buffers, raw_bs, bs)
        self.stats.seconds += time.perf_counter() - start
        return self.snapshot(inputs, raw_bs)

    def snapshot(self, inputs: Any, raw_bs: int | None = None) -> _ReplayCheck:
        """Check the pools, the live index values and the writer indices, and
        snapshot the guarded state. The eager fallback, which has no padded
        tails, starts its check here. ``raw_bs`` defaults to ``inputs.batch_size``;
        without either, the live values are not checked (the writers still are)."""
        start = time.perf_counter()
        self.check_pools()
        raw_bs = _batch_size(inputs) if raw_bs is None else raw_bs
        if raw_bs is not None:
            self.check_live_values(inputs, raw_bs)
        for guard in self.guarded:
            check_writers(guard, inputs)
        check = _ReplayCheck(self, inputs, [g.tensor.clone() for g in self.guarded])
        self.stats.seconds += time.perf_counter() - start
        return check


def _batch_size(inputs: Any) -> int | None:
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
                f"{guard.name} row {row} changed during replay (element {col}: {old!r} -> "
                f"{new!r}) but is {_owner(guard)}: a padded row, or a stray write, changed "
                f"state the step does not own"
            )
