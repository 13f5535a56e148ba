"""The sanitizer's live-value checks, driven by what each buffer declares it
indexes (:attr:`~graphrunner.declare.buffers.BufferSpec.indexes`), so every
phase (decode, verify, EAGLE, MTP) gets the checks its buffers call for.

A buffer of ``r`` rows per request is read as ``raw_bs * r`` live values; a
field missing from the inputs, or of another shape, is skipped (its check
needs it), never guessed. Reads the device: the sanitizer is a debug mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from graphrunner.declare.buffers import Axis, BufferSpec, Index, Size, units
from graphrunner.declare.decode import DECODE_HOST_MIRRORS, decode_buffer_specs
from graphrunner.pools import ReqToTokenPool
from graphrunner.sanitizer.checks import (
    SlotOwner,
    check_kv_owner,
    check_kv_slots,
    check_mirror,
    check_req_rows,
    live_ints,
    row_violation,
)

if TYPE_CHECKING:
    from graphrunner.sanitizer.shared import SharedPages

__all__ = ["DEFAULT_VALUE_SPECS", "LiveValue", "ValueContext", "check_declared_values"]

#: The declarations checked when a caller gives none: the decode step's.
DEFAULT_VALUE_SPECS: tuple[BufferSpec, ...] = tuple(decode_buffer_specs(mamba=True))


@dataclass(frozen=True, slots=True)
class LiveValue:
    """One declared buffer's live values (host ints, ``raw_bs * r`` of them)."""

    spec: BufferSpec
    values: list[int]


@dataclass(frozen=True, slots=True)
class ValueContext:
    """What the checks compare against: the request pool, the KV allocator,
    the vocabulary size and the pool's shared pages (prefix caching), each
    None when the sanitizer was not given it."""

    req_pool: ReqToTokenPool | None
    kv_allocator: SlotOwner | None
    vocab_size: int | None
    shared: SharedPages | None = None


def live_values(
    specs: Sequence[BufferSpec], inputs: object, raw_bs: Size
) -> dict[Index, LiveValue]:
    """The live values of each declared index (the first buffer of each kind;
    counts are checked one by one in :func:`check_declared_values`)."""
    found: dict[Index, LiveValue] = {}
    for spec in specs:
        if spec.indexes is None or spec.host or spec.indexes in found:
            continue
        values = live_ints(inputs, spec.name, spec.rows(raw_bs))
        if values is not None:
            found[spec.indexes] = LiveValue(spec, values)
    return found


def check_declared_values(
    specs: Sequence[BufferSpec], inputs: object, raw_bs: Size, ctx: ValueContext
) -> None:
    """Every live value is one the step may use, as its buffer declares."""
    live = live_values(specs, inputs, raw_bs)
    rows = live.get(Index.REQUEST_ROW)
    if rows is not None and ctx.req_pool is not None:
        check_req_rows(ctx.req_pool, rows.values)
    _check_mirrors(live, inputs, units(Axis.REQUEST, raw_bs))
    owners = _token_owners(live, raw_bs)
    _check_lengths(live, ctx.req_pool, owners)
    _check_kv(live, ctx, owners)
    _check_shared(live, ctx, owners)
    _check_token_rows(live.get(Index.TOKEN_ROW), owners)
    _check_reserved(live.get(Index.RESERVED_KV_SLOT), ctx)
    _check_tokens(live.get(Index.TOKEN), ctx.vocab_size)
    _check_counts(specs, inputs, raw_bs)
    _check_mamba(live.get(Index.MAMBA_SLOT))


def _check_mirrors(live: dict[Index, LiveValue], inputs: object, raw_bs: int) -> None:
    """Device values equal the host mirrors the scheduler planned from."""
    by_name = {v.spec.name: v.values for v in live.values() if v.spec.rows_per_request == 1}
    for field, mirror in DECODE_HOST_MIRRORS.items():
        check_mirror(field, by_name.get(field), live_ints(inputs, mirror, raw_bs))


def _token_owners(live: dict[Index, LiveValue], raw_bs: Size) -> list[tuple[int, int, int]] | None:
    """A token batch's live tokens as ``(request, tokens it owns, j)``, the
    ``j``-th of its request's tokens, from the declared token counts (each
    >= 1, summing to the live tokens: checked here); None for a one-axis
    step, or where the counts are not declared."""
    counts = live.get(Index.TOKEN_COUNT)
    if not isinstance(raw_bs, tuple) or counts is None:
        return None
    name = counts.spec.name
    for i, n in enumerate(counts.values):
        if n < 1:
            raise row_violation(name, i, n, "a live request's tokens in the step, >= 1")
    if sum(counts.values) != raw_bs.tokens:
        raise row_violation(
            name,
            0,
            counts.values[0],
            f"counts summing to the {raw_bs.tokens} live tokens (they sum to {sum(counts.values)})",
        )
    return [(i, n, j) for i, n in enumerate(counts.values) for j in range(n)]


def _check_lengths(
    live: dict[Index, LiveValue],
    req_pool: ReqToTokenPool | None,
    owners: list[tuple[int, int, int]] | None = None,
) -> None:
    """Lengths in ``1..width`` (the req_to_token width) and each request's
    ``r`` positions the last ``r`` of its length: ``seq_lens - r + j`` for
    its token ``j`` (decode: ``seq_lens - 1``; a token batch: ``r`` its
    declared token count, the positions on the token axis)."""
    lengths, positions = live.get(Index.LENGTH), live.get(Index.POSITION)
    if lengths is None or lengths.spec.rows_per_request != 1:
        return
    name = lengths.spec.name
    width = None if req_pool is None else int(req_pool.req_to_token.shape[1])
    top = f"..{width}" if width is not None else " or more"
    for i, n in enumerate(lengths.values):
        if n < 1 or (width is not None and n > width):
            raise row_violation(name, i, n, f"1{top} (the req_to_token width)")
    if positions is None:
        return
    if positions.spec.axis is Axis.TOKEN:
        if owners is None:
            return
        for k, ((i, r, j), p) in enumerate(zip(owners, positions.values, strict=True)):
            n = lengths.values[i]
            if p != n - r + j:
                want = f"{name}[{i}] - {r - j} = {n - r + j}"
                raise row_violation(positions.spec.name, k, p, want)
        return
    r = positions.spec.rows_per_request
    for k, p in enumerate(positions.values):
        n, j = lengths.values[k // r], k % r
        if p != n - r + j:
            raise row_violation(positions.spec.name, k, p, f"{name} - {r - j} = {n - r + j}")


def _check_kv(
    live: dict[Index, LiveValue],
    ctx: ValueContext,
    owners: list[tuple[int, int, int]] | None = None,
) -> None:
    """Each live KV slot allocated, not 0, once, and the one its request
    recorded at the token's position."""
    locs = live.get(Index.KV_SLOT)
    if locs is None:
        return
    check_kv_slots(ctx.kv_allocator, locs.values)
    rows, positions = live.get(Index.REQUEST_ROW), live.get(Index.POSITION)
    if ctx.req_pool is None or rows is None or positions is None:
        return
    if locs.spec.axis is Axis.TOKEN:
        if owners is not None and positions.spec.axis is Axis.TOKEN:
            per_token = [rows.values[i] for i, _, _ in owners]
            check_kv_owner(ctx.req_pool.req_to_token, per_token, positions.values, locs.values)
        return
    r = locs.spec.rows_per_request
    if positions.spec.rows_per_request != r or rows.spec.rows_per_request != 1:
        return
    per_token = [row for row in rows.values for _ in range(r)]
    check_kv_owner(ctx.req_pool.req_to_token, per_token, positions.values, locs.values)


def _check_shared(
    live: dict[Index, LiveValue],
    ctx: ValueContext,
    owners: list[tuple[int, int, int]] | None = None,
) -> None:
    """With shared pages: every page a live request maps is still held, and
    no live KV write (``out_cache_loc``, a multi-step launch's reserved
    slots) lands in a shared or indexed page."""
    if ctx.shared is None:
        return
    from graphrunner.sanitizer.shared import check_shared_writes, mapped_pages  # on first use

    rows, lengths = live.get(Index.REQUEST_ROW), live.get(Index.LENGTH)
    mappers = None
    if rows is not None and not _one_per_request(rows):
        rows = None  # which request a value is, is not said
    if lengths is not None and not _one_per_request(lengths):
        lengths = None
    if ctx.req_pool is not None and rows is not None and lengths is not None:
        req_to_token = ctx.req_pool.req_to_token
        mappers = mapped_pages(ctx.shared, req_to_token, rows.values, lengths.values)
    for index in (Index.KV_SLOT, Index.RESERVED_KV_SLOT):
        locs = live.get(index)
        if locs is not None:
            who = _write_rows(locs, rows, owners)
            check_shared_writes(ctx.shared, locs.values, who, mappers, field=locs.spec.name)


def _one_per_request(value: LiveValue) -> bool:
    return value.spec.axis is Axis.REQUEST and value.spec.rows_per_request == 1


def _write_rows(
    locs: LiveValue, rows: LiveValue | None, owners: list[tuple[int, int, int]] | None
) -> list[int | None] | None:
    """The request row of each live write, where the layout says it."""
    if rows is None:
        return None
    if locs.spec.axis is Axis.TOKEN:
        return None if owners is None else [rows.values[i] for i, _, _ in owners]
    r = locs.spec.rows_per_request
    return [rows.values[k // r] for k in range(len(locs.values))]


def _check_token_rows(rows: LiveValue | None, owners: list[tuple[int, int, int]] | None) -> None:
    """Each request's token row is its own last token's (a row of another
    request's tokens, or a padded one, would give it their outputs)."""
    if rows is None or owners is None:
        return
    last = {i: k for k, (i, _, _) in enumerate(owners)}  # a request's last token wins
    for i, row in enumerate(rows.values):
        if row != last.get(i):
            raise row_violation(rows.spec.name, i, row, f"{last.get(i)}, its request's last token")


def _check_reserved(locs: LiveValue | None, ctx: ValueContext) -> None:
    """Reserved KV slots (a multi-step launch's): each non-zero one allocated
    and once; a 0 is a step the row does not take (it writes the sink)."""
    if locs is not None:
        check_kv_slots(ctx.kv_allocator, [s for s in locs.values if s != 0])


def _check_tokens(tokens: LiveValue | None, vocab_size: int | None) -> None:
    """Token ids in ``0..vocab_size - 1`` (future references ``< 0`` pass:
    populate resolves them)."""
    if tokens is None or vocab_size is None:
        return
    for i, t in enumerate(tokens.values):
        if not (0 <= t < vocab_size or (t < 0 and tokens.spec.future)):
            raise row_violation(tokens.spec.name, i, t, f"a token id in 0..{vocab_size - 1}")


def _check_counts(specs: Sequence[BufferSpec], inputs: object, raw_bs: Size) -> None:
    """Each count in ``1..W``, the buffer's width."""
    for spec in specs:
        if spec.indexes is not Index.COUNT or spec.width is None:
            continue
        for i, c in enumerate(live_ints(inputs, spec.name, spec.rows(raw_bs)) or []):
            if not 1 <= c <= spec.width:
                raise row_violation(spec.name, i, c, f"a count in 1..{spec.width}")


def _check_mamba(slots: LiveValue | None) -> None:
    """Live Mamba slots are never the sink 0 (whose slot a request owns is the
    hybrid pool's to say: the engine's Mamba sanitizer checks that)."""
    if slots is None:
        return
    for i, s in enumerate(slots.values):
        if s == 0:
            raise row_violation(slots.spec.name, i, s, "a live Mamba slot, never the sink 0")
