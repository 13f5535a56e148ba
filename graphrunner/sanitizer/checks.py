"""The checks the padding sanitizer runs, as plain functions: padded tails,
finite outputs, live index values, and the rows a step may write.

Each raises :class:`PaddingViolation` naming the field, the row and the value.
They may read the device: the sanitizer is a debug mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from graphrunner.declare.buffers import Size, StaticBuffers
from graphrunner.declare.decode import (
    DECODE_FIELDS,
    DECODE_HOST_MIRRORS,
    OUT_CACHE_LOC,
    POSITIONS,
    REQ_POOL_INDICES,
)
from graphrunner.declare.outputs import Outputs
from graphrunner.pools import ReqToTokenPool

__all__ = [
    "VALUE_FIELDS",
    "GuardedTensor",
    "PaddingViolation",
    "SlotOwner",
    "check_finite",
    "check_kv_owner",
    "check_mirror",
    "check_kv_slots",
    "check_req_rows",
    "check_tails",
    "check_writers",
    "live_ints",
    "row_violation",
]


class PaddingViolation(AssertionError):
    """A padding invariant failed; the message names the buffer, row and value."""


@dataclass(frozen=True, slots=True)
class GuardedTensor:
    """State a replay may write only at the live rows' own indices.

    ``tensor`` is ``[slots, ...]``, indexed by slot along dim 0 (a KV layer
    ``[kv_slots, heads, head_dim]``, ``req_to_token`` ``[rows, context]``, a
    model's own per-request state ``[rows, ...]``); ``writer`` names the input
    field whose live values are the rows a step may write (e.g.
    ``out_cache_loc`` for KV, ``req_pool_indices`` for per-request state), or
    is None for state a step only reads (``req_to_token`` in decode); rows
    ``0..sink_rows-1`` are padding sinks any padded row may write. A write
    that leaves a row's value unchanged cannot be seen. ``unit`` is what a
    message calls one of its rows (default: ``"KV slot"`` where
    ``out_cache_loc`` writes it, ``"request row"`` where ``req_pool_indices``
    does, else ``"row"``).
    """

    name: str
    tensor: torch.Tensor
    writer: str | None
    sink_rows: int = 1
    unit: str | None = None

    @property
    def row_name(self) -> str:
        if self.unit is not None:
            return self.unit
        return {OUT_CACHE_LOC: "KV slot", REQ_POOL_INDICES: "request row"}.get(
            self.writer or "", "row"
        )


def _first_bad_row(bad: torch.Tensor) -> int:
    return int(torch.nonzero(bad.reshape(bad.shape[0], -1).any(1))[0])


def check_tails(buffers: StaticBuffers, raw_bs: Size, bs: Size) -> None:
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
            bad = ~torch.isfinite(t)
            row = _first_bad_row(bad)
            first = [tuple(int(i) for i in p) for p in bad.nonzero()[:3].tolist()]
            raise PaddingViolation(
                f"output {name!r} batch row {row} is not finite: {int(bad.sum())} of "
                f"{t.numel()} values, first at {first}"
            )


#: The decode fields whose live values the sanitizer checks (those declaring
#: what they index), host mirrors included.
VALUE_FIELDS: tuple[str, ...] = (
    *(s.name for s in DECODE_FIELDS if s.indexes is not None),
    *DECODE_HOST_MIRRORS.values(),
)


class SlotOwner(Protocol):
    """A pool that can say whether it handed out a slot (every library pool can)."""

    def is_allocated(self, slot: int) -> bool: ...


def row_violation(
    field: str, row: int, value: int, expected: str, request: int | None = None
) -> PaddingViolation:
    """``{field} batch row {row} (request row {request}) = {value}: expected ...``:
    a live row's input value, named by its batch row and, where known, its
    request's row of the request pool."""
    of = "" if request is None else f" (request row {request})"
    return PaddingViolation(f"{field} batch row {row}{of} = {value}: expected {expected}")


def _is_index_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())


def live_ints(inputs: object, name: str, raw_bs: int) -> list[int] | None:
    """Field ``name``'s live values as host ints (a device read: debug mode
    only), or None when ``inputs`` has no 1-D integer ``name`` of ``raw_bs``
    rows (the live rows of its buffer: ``raw_bs * r`` for ``r`` rows per
    request): a field of another layout is skipped rather than guessed."""
    t = getattr(inputs, name, None)
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != raw_bs:
        return None
    return [int(v) for v in t.tolist()] if _is_index_dtype(t) else None


def _check_once(field: str, values: list[int], what: str) -> None:
    first_row: dict[int, int] = {}
    for i, v in enumerate(values):
        if v in first_row:
            raise row_violation(
                field, i, v, f"each {what} once (batch row {first_row[v]} has it too)"
            )
        first_row[v] = i


def check_mirror(field: str, device: list[int] | None, host: list[int] | None) -> None:
    """The device values the graph reads equal the host mirror the scheduler
    planned from: a stale device tensor would read other columns silently."""
    if device is None or host is None:
        return
    for i, (d, h) in enumerate(zip(device, host, strict=True)):
        if d != h:
            mirror = DECODE_HOST_MIRRORS[field]
            raise row_violation(field, i, d, f"{h}, its host mirror {mirror}[{i}]")


def check_req_rows(req_pool: ReqToTokenPool, rows: list[int]) -> None:
    """Each live row is an allocated request row other than the padding row 0, once."""
    last = req_pool.req_to_token.shape[0] - 1
    for i, r in enumerate(rows):
        if r == 0:
            raise row_violation(REQ_POOL_INDICES, i, r, "a live request row, not the padding row 0")
        if not 1 <= r <= last:
            raise row_violation(REQ_POOL_INDICES, i, r, f"a request row in 1..{last}")
        if not req_pool.is_allocated(r):
            raise row_violation(
                REQ_POOL_INDICES, i, r, "an allocated request row (it is free: finished?)"
            )
    _check_once(REQ_POOL_INDICES, rows, "request row")


def check_kv_slots(kv_allocator: SlotOwner | None, locs: list[int]) -> None:
    """Each live slot is an allocated KV slot other than the padding slot 0, once."""
    for i, s in enumerate(locs):
        if s == 0:
            raise row_violation(OUT_CACHE_LOC, i, s, "a live KV slot, not the padding slot 0")
        if kv_allocator is not None and not kv_allocator.is_allocated(s):
            raise row_violation(
                OUT_CACHE_LOC, i, s, "an allocated KV slot (it is free or out of range)"
            )
    _check_once(OUT_CACHE_LOC, locs, "KV slot")


def check_kv_owner(
    req_to_token: torch.Tensor, rows: list[int], positions: list[int], locs: list[int]
) -> None:
    """Each live slot is the one its request recorded for the new token
    (``prepare_decode`` writes it before the step, paged or not): any other
    slot is another request's KV, which the step would overwrite."""
    width = req_to_token.shape[1]
    for i, p in enumerate(positions):
        if not 0 <= p < width:  # reached when seq_lens is absent and did not bound it
            raise row_violation(POSITIONS, i, p, f"a req_to_token column in 0..{width - 1}")
    device = req_to_token.device
    at_rows, at_cols = (
        torch.tensor(x, dtype=torch.int64, device=device) for x in (rows, positions)
    )
    recorded = req_to_token[at_rows, at_cols].tolist()
    for i, (r, p, s, rec) in enumerate(zip(rows, positions, locs, recorded, strict=True)):
        if s != rec:
            raise row_violation(
                OUT_CACHE_LOC,
                i,
                s,
                f"KV slot {rec} (req_to_token[{r}, {p}]), the one its request owns",
                r,
            )


def check_writers(guard: GuardedTensor, inputs: object) -> torch.Tensor | None:
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
        raise row_violation(
            guard.writer, i, int(flat[i]), f"a row of {guard.name} in 0..{rows - 1}"
        )
    return flat
