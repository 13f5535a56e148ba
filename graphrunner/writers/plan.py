"""Populate's write plans: for one ``(raw_bs, bs)``, which views receive
which source, planned once and cached.

On the CPU, where every copy costs host time of its own, a pack of several
small buffers (:mod:`graphrunner.declare.packs`) whose every member has a pad
value is written by one staged ``torch.cat``: the members' live rows and
padded tails, interleaved in storage order, land in one contiguous target at
once. The target is the pack's own storage when ``bs`` is its largest size;
below it, a staging tensor of the ``bs`` rows, copied into the pack's
``[:, :rows(bs)]`` view by one strided copy. Every other destination (on a
device, where one launch writes a whole group; a pack with a kept tail, one
member or large rows) is written by one ``_foreach_copy_`` per (device,
dtype), live rows and tails together. On the CPU every source is a CPU tensor
(the input checks hold it), so ``cat`` takes whatever the foreach copy would.
Only the views and pad rows are built here; the values written come from the
declared pad rules (:meth:`~graphrunner.declare.buffers.BufferSpec.pad_value`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

import torch

from graphrunner.declare.buffers import BufferSpec, Size, StaticBuffers, fits, has_rows
from graphrunner.declare.packs import BufferPack

__all__ = ["Plan", "PopulateError", "plan_for"]


class PopulateError(ValueError):
    """An input does not match its declared buffer (names the field)."""


#: A pad source up to this many bytes is materialized (a dense source keeps
#: the copies on their fast path); a larger one is one row, expanded. A pack
#: up to this size is staged below its largest size (a larger one would
#: double its bytes moved: it is copied per field instead).
SMALL_BYTES = 1 << 16


#: Where a source goes in a staged pack's template (replaced before each cat).
HOLE = torch.empty(0)


@dataclass(frozen=True, slots=True)
class CopyGroup:
    """Destinations of one (device, dtype), written by one ``_foreach_copy_``:
    the live rows of the specs at ``index`` (from their sources), then the
    padded tails (from ``pads``, precomputed rows of each rule's value)."""

    index: tuple[int, ...]  # positions of the group's specs in buffers.specs
    dsts: list[torch.Tensor]  # live heads (one per index), then padded tails
    pads: list[torch.Tensor]  # the tails' sources, one per tail


@dataclass(frozen=True, slots=True)
class StagedPack:
    """One pack written by one ``torch.cat`` into ``out`` (then, below the
    pack's largest size, one copy of ``out`` into ``dst``)."""

    #: The members' sources, picked from all sources (None: no live rows).
    take: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]] | None
    parts: list[torch.Tensor]  # cat's inputs: pads in place, HOLE where a source goes
    live: slice  # where the sources go in ``parts``
    out: torch.Tensor
    dst: tuple[torch.Tensor, torch.Tensor] | None  # (pack[:, :rows(bs)], out as it) if staged

    @property
    def device_ops(self) -> int:
        return 1 if self.dst is None else 2


@dataclass(frozen=True, slots=True)
class Plan:
    staged: tuple[StagedPack, ...]
    copies: tuple[CopyGroup, ...]
    gathers: tuple[torch.Tensor, ...]  # live rows holding future references to resolve
    future: torch.Tensor | None
    #: Device operations a write issues (a gather is one resolve: index,
    #: compare, select counted as one); counted once, read every replay.
    device_ops: int = field(init=False)

    def __post_init__(self) -> None:
        staged = sum(p.device_ops for p in self.staged)
        object.__setattr__(self, "device_ops", staged + len(self.copies) + len(self.gathers))


_plans: weakref.WeakKeyDictionary[StaticBuffers, dict[tuple[Size, Size, bool], Plan]] = (
    weakref.WeakKeyDictionary()
)
_pad_rows: weakref.WeakKeyDictionary[StaticBuffers, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _pad_source(buffers: StaticBuffers, spec: BufferSpec, value: int | float) -> torch.Tensor:
    """Rows of ``spec``'s pad value, as many as its buffer holds: made once
    per buffers (plan time, never at replay), sliced per tail."""
    value = 0 if value == 0 else value  # a fill of -0.0 pads +0, as the fused writer does
    per_buffers = _pad_rows.setdefault(buffers, {})
    rows = per_buffers.get(spec.name)
    if rows is None:
        buf = buffers.tensors[spec.name]
        row = torch.full((1, *spec.extra_shape), value, dtype=spec.dtype, device=buf.device)
        dense = buf.numel() * buf.element_size() <= SMALL_BYTES
        rows = row.expand(buf.shape).contiguous() if dense else row.expand(buf.shape)
        per_buffers[spec.name] = rows
    return rows


def _tail(buffers: StaticBuffers, spec: BufferSpec, raw_bs: Size, bs: Size) -> torch.Tensor | None:
    """The pad rows of ``spec`` for ``[raw_bs:bs]`` (None: no tail, or kept)."""
    live, total = spec.rows(raw_bs), spec.rows(bs)
    value = spec.pad_value()
    if total == live or value is None:
        return None
    return _pad_source(buffers, spec, value)[: total - live]


def _copy_groups(
    buffers: StaticBuffers, specs: list[tuple[int, BufferSpec]], raw_bs: Size, bs: Size
) -> list[CopyGroup]:
    """One foreach group per (device, dtype) of ``specs`` (index, spec)."""
    heads: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    tails: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for i, spec in specs:
        group = (buffers.device_of(spec), spec.dtype)
        live, total = spec.rows(raw_bs), spec.rows(bs)
        if live:
            heads.setdefault(group, []).append(i)
        pad = _tail(buffers, spec, raw_bs, bs)
        if pad is not None:
            tails.setdefault(group, []).append((buffers.tensors[spec.name][live:total], pad))
    groups = []
    for group in {**heads, **tails}:
        index = heads.get(group, [])
        padded = tails.get(group, [])
        heads_of = [buffers.specs[i] for i in index]
        dsts = [buffers.tensors[s.name][: s.rows(raw_bs)] for s in heads_of]
        dsts.extend(t for t, _ in padded)
        groups.append(CopyGroup(tuple(index), dsts, [p for _, p in padded]))
    return groups


def _getter(index: list[int]) -> Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]:
    if len(index) == 1:
        only = index[0]
        return lambda sources: (sources[only],)
    return itemgetter(*index)


def _staged(
    buffers: StaticBuffers,
    pack: BufferPack,
    members: list[tuple[int, BufferSpec]],
    raw_bs: Size,
    bs: Size,
) -> StagedPack | None:
    """``pack`` as one staged write, or None when it is better written per
    field (a kept tail, one member, large rows, or a device pack)."""
    rows = members[0][1].rows(bs)
    pads = [_tail(buffers, spec, raw_bs, bs) for _, spec in members]
    live_rows = members[0][1].rows(raw_bs)
    has_tail = rows > live_rows
    if has_tail and any(p is None for p in pads):
        return None  # a kept tail: its rows are not rewritten
    storage = pack.storage
    full = rows == storage.shape[1]
    if storage.device.type != "cpu" or len(members) < 2:
        # Staging pays where each copy costs host time of its own (the CPU)
        # and several buffers share it; a device's one foreach launch per
        # (device, dtype) already writes every buffer of the group.
        return None
    if storage.numel() * storage.element_size() > SMALL_BYTES:
        return None  # large rows: the foreach copy moves them once, with dense pads
    parts: list[torch.Tensor] = []
    for pad in pads:
        if live_rows:
            parts.append(HOLE)
        if pad is not None:
            parts.append(pad)
    if not parts:
        return None  # nothing to write
    take = _getter([i for i, _ in members]) if live_rows else None
    live = slice(0, None, 2) if has_tail else slice(None)
    row_shape = storage.shape[2:]
    if full:
        return StagedPack(take, parts, live, storage.view(-1, *row_shape), None)
    staging = torch.empty(
        (len(members) * rows, *row_shape), dtype=storage.dtype, device=storage.device
    )
    dst = (storage[:, :rows], staging.view(len(members), rows, *row_shape))
    return StagedPack(take, parts, live, staging, dst)


def _make_plan(buffers: StaticBuffers, raw_bs: Size, bs: Size, host_only: bool) -> Plan:
    position = {s.name: i for i, s in enumerate(buffers.specs)}
    staged: list[StagedPack] = []
    rest: list[tuple[int, BufferSpec]] = []
    for pack in buffers.packs:
        members = [(position[n], buffers.specs[position[n]]) for n in pack.names]
        if host_only:  # the host members alone (on the CPU a pack may mix them)
            rest.extend(m for m in members if m[1].host)
            continue
        one = _staged(buffers, pack, members, raw_bs, bs)
        if one is None:
            rest.extend(members)
        else:
            staged.append(one)
    gathers = tuple(
        buffers.tensors[s.name][: s.rows(raw_bs)]
        for s in buffers.specs
        if s.future and has_rows(raw_bs) and not host_only
    )
    copies = _copy_groups(buffers, sorted(rest, key=lambda m: m[0]), raw_bs, bs)
    return Plan(tuple(staged), tuple(copies), gathers, buffers.future_tokens)


def plan_for(buffers: StaticBuffers, raw_bs: Size, bs: Size, host_only: bool = False) -> Plan:
    """The cached plan of ``(raw_bs, bs)`` (PopulateError outside ``0..max_bs``;
    a token batch's on both axes); ``host_only``: of the host buffers alone."""
    per_buffers = _plans.get(buffers)
    if per_buffers is None:
        per_buffers = _plans.setdefault(buffers, {})
    plan = per_buffers.get((raw_bs, bs, host_only))
    if plan is None:
        raw, size = buffers.size_of(raw_bs), buffers.size_of(bs)
        if not fits(raw, size, buffers.max_size):
            raise PopulateError(
                f"need 0 <= raw_bs <= bs <= max_bs, got raw_bs={raw}, bs={size}, "
                f"max_bs={buffers.max_size}"
            )
        plan = _make_plan(buffers, raw, size, host_only)
        per_buffers[(raw_bs, bs, host_only)] = plan
    return plan
