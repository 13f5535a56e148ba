"""The one routine that writes static buffers: live rows copied, padded rows
set by each buffer's declared :class:`~graphrunner.declare.buffers.PadRule`.

No other code in graphrunner writes a pad value. Populate is graph-safe host
code: it allocates no device memory, reads nothing back from the device, and
walks the declared fields once. The views it writes through are planned once
per ``(raw_bs, bs)`` and cached.

Two halves: :func:`check_sources` validates an input object against the
declarations and returns its tensors (one per buffer, in declaration order);
:func:`write_sources` writes them (grouped torch ops: the reference writer).
:func:`populate` is both. The replay path validates once per input object
(:mod:`graphrunner.core.input_check`) and may hand the sources to another writer
driven by the same declarations (:mod:`graphrunner.writers.fused`), which
must equal :func:`write_sources` bit for bit.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from graphrunner.declare.buffers import BufferSpec, StaticBuffers

__all__ = [
    "PopulateError",
    "TorchWriter",
    "check_inputs",
    "check_sources",
    "populate",
    "resolve_futures",
    "write_sources",
]


class PopulateError(ValueError):
    """An input does not match its declared buffer (names the field)."""


@dataclass(frozen=True, slots=True)
class _CopyGroup:
    """Destinations of one (device, dtype), written by one ``_foreach_copy_``:
    the live rows of the specs at ``index`` (from their sources), then the
    padded tails (from ``pads``, precomputed rows of each rule's value)."""

    index: tuple[int, ...]  # positions of the group's specs in buffers.specs
    dsts: list[torch.Tensor]  # live heads (one per index), then padded tails
    pads: list[torch.Tensor]  # the tails' sources, one per tail


@dataclass(frozen=True, slots=True)
class _Plan:
    copies: tuple[_CopyGroup, ...]
    gathers: tuple[torch.Tensor, ...]  # live rows holding future references to resolve
    future: torch.Tensor | None

    @property
    def device_ops(self) -> int:
        # A gather is one resolve (index, compare, select: counted as one).
        return len(self.copies) + len(self.gathers)


_plans: weakref.WeakKeyDictionary[StaticBuffers, dict[tuple[int, int, bool], _Plan]] = (
    weakref.WeakKeyDictionary()
)
_pad_rows: weakref.WeakKeyDictionary[StaticBuffers, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
#: A pad source up to this many bytes is materialized (a dense source keeps
#: the foreach copy on its fast path); a larger one is one row, expanded.
_DENSE_PAD_BYTES = 1 << 16


def _pad_source(buffers: StaticBuffers, spec: BufferSpec, value: int | float) -> torch.Tensor:
    """Rows of ``spec``'s pad value, as many as its buffer holds: made once
    per buffers (plan time, never at replay), sliced per tail."""
    value = 0 if value == 0 else value  # a fill of -0.0 pads +0, as the fused writer does
    per_buffers = _pad_rows.setdefault(buffers, {})
    rows = per_buffers.get(spec.name)
    if rows is None:
        buf = buffers.tensors[spec.name]
        row = torch.full((1, *spec.extra_shape), value, dtype=spec.dtype, device=buf.device)
        dense = buf.numel() * buf.element_size() <= _DENSE_PAD_BYTES
        rows = row.expand(buf.shape).contiguous() if dense else row.expand(buf.shape)
        per_buffers[spec.name] = rows
    return rows


def _make_plan(buffers: StaticBuffers, raw_bs: int, bs: int, host_only: bool) -> _Plan:
    # Grouped by (device, dtype): one foreach copy per group, host buffers apart.
    index: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    tails: dict[tuple[torch.device, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    specs = buffers.specs
    for i, spec in enumerate(specs):
        if host_only and not spec.host:
            continue
        group = (buffers.device_of(spec), spec.dtype)
        live, total = spec.rows(raw_bs), spec.rows(bs)
        if live:
            index.setdefault(group, []).append(i)
        value = spec.pad_value()
        if total == live or value is None:
            continue
        pad = _pad_source(buffers, spec, value)[: total - live]
        tails.setdefault(group, []).append((buffers.tensors[spec.name][live:total], pad))
    groups = []
    for group in {**index, **tails}:
        heads = index.get(group, [])
        padded = tails.get(group, [])
        dsts = [buffers.tensors[specs[i].name][: specs[i].rows(raw_bs)] for i in heads]
        dsts.extend(t for t, _ in padded)
        groups.append(_CopyGroup(tuple(heads), dsts, [p for _, p in padded]))
    gathers = tuple(
        buffers.tensors[s.name][: s.rows(raw_bs)]
        for s in specs
        if s.future and raw_bs and not host_only
    )
    return _Plan(tuple(groups), gathers, buffers.future_tokens)


def plan_for(buffers: StaticBuffers, raw_bs: int, bs: int, host_only: bool = False) -> _Plan:
    """The cached plan of ``(raw_bs, bs)`` (PopulateError outside ``0..max_bs``);
    ``host_only``: of the host buffers alone."""
    per_buffers = _plans.get(buffers)
    if per_buffers is None:
        per_buffers = _plans.setdefault(buffers, {})
    plan = per_buffers.get((raw_bs, bs, host_only))
    if plan is None:
        if not 0 <= raw_bs <= bs <= buffers.max_bs:
            raise PopulateError(
                f"need 0 <= raw_bs <= bs <= max_bs, got raw_bs={raw_bs}, bs={bs}, "
                f"max_bs={buffers.max_bs}"
            )
        plan = _make_plan(buffers, raw_bs, bs, host_only)
        per_buffers[(raw_bs, bs, host_only)] = plan
    return plan


def _source(
    spec: BufferSpec, inputs: object, rows: int, device: torch.device, *, any_width: bool = False
) -> torch.Tensor:
    src = getattr(inputs, spec.name, None)
    if src is None:
        raise PopulateError(f"input {spec.name!r} is missing from {type(inputs).__name__}")
    if not isinstance(src, torch.Tensor):
        raise PopulateError(f"input {spec.name!r} must be a torch.Tensor, got {type(src).__name__}")
    if src.dtype != spec.dtype:
        raise PopulateError(f"input {spec.name!r} has dtype {src.dtype}, expected {spec.dtype}")
    if src.device != device and not (src.device.type == "cpu" and spec.takes_host_source):
        host_too = spec.takes_host_source and device.type != "cpu"
        also = " (or cpu: a host-produced input)" if host_too else ""
        raise PopulateError(f"input {spec.name!r} is on {src.device}, expected {device}{also}")
    # any_width: a per-token field of an eager batch may hold another whole
    # number of rows per request than the captured width.
    requests = rows // spec.rows_per_request
    length_ok = src.dim() > 0 and (
        src.shape[0] == rows or (any_width and src.shape[0] > 0 and src.shape[0] % requests == 0)
    )
    if not length_ok or src.shape[1:] != spec.extra_shape:
        raise PopulateError(
            f"input {spec.name!r} has shape {tuple(src.shape)}, expected "
            f"{(rows, *spec.extra_shape)} (length must be the live rows)"
        )
    return src


def check_sources(buffers: StaticBuffers, inputs: object, raw_bs: int) -> list[torch.Tensor]:
    """Every declared input of ``inputs`` for ``raw_bs >= 1`` live requests,
    validated (present, a tensor, dtype, device, ``[spec.rows(raw_bs),
    *extra_shape]``), in the order of ``buffers.specs``. The device is the
    buffer's, or the host for a buffer that
    :attr:`~graphrunner.declare.buffers.BufferSpec.takes_host_source`."""
    return [
        _source(spec, inputs, spec.rows(raw_bs), buffers.device_of(spec)) for spec in buffers.specs
    ]


def populate(buffers: StaticBuffers, inputs: object | None, raw_bs: int, bs: int) -> int:
    """Copy ``raw_bs`` live requests from ``inputs`` into the head of every
    buffer and apply each pad rule to rows ``[raw_bs:bs]`` only.

    Args:
        buffers: the runner's static buffers.
        inputs: any object with one tensor attribute per declared buffer, of
            ``raw_bs * rows_per_request`` rows; may be None only when
            ``raw_bs == 0`` (capture writes an all-padding batch this way).
        raw_bs: live requests.
        bs: the captured size replayed, ``raw_bs <= bs <= max_bs``.

    Returns:
        The number of operations issued: one ``torch._foreach_copy_`` per
        (device, dtype), writing the live rows and the padded tails (from
        precomputed rows of each pad value) at once, host buffers' included;
        one resolve per future buffer. Every input is validated before
        anything is written.
    """
    if inputs is None and raw_bs:
        raise PopulateError(f"inputs are required for raw_bs={raw_bs} > 0")
    plan = plan_for(buffers, raw_bs, bs)  # size errors before input errors
    sources = check_sources(buffers, inputs, raw_bs) if raw_bs else []
    return _write_planned(plan, sources)


def write_sources(
    buffers: StaticBuffers,
    sources: Sequence[torch.Tensor],
    raw_bs: int,
    bs: int,
    *,
    host_only: bool = False,
) -> int:
    """Write already validated ``sources`` (one per spec, in declaration
    order; empty when ``raw_bs == 0``): the torch writer of :func:`populate`.

    ``host_only`` writes the host buffers only (a writer that does the
    device buffers in one launch calls this for the rest). Returns the
    operations issued, as :func:`populate`.
    """
    return _write_planned(plan_for(buffers, raw_bs, bs, host_only), sources)


class TorchWriter:
    """The torch writer of one runner's buffers as a
    :class:`~graphrunner.mechanisms.base.PopulateWriter`: :func:`write_sources`
    with its plans held in a plain dict (the replay path's default writer).

    Args:
        buffers: the static buffers it writes (``[max_bs * rows_per_request,
            *extra_shape]`` each).
    """

    def __init__(self, buffers: StaticBuffers) -> None:
        self.buffers = buffers
        self._plans: dict[tuple[int, int], _Plan] = {}

    def write(self, sources: Sequence[torch.Tensor], raw_bs: int, bs: int) -> int:
        """Write ``raw_bs`` live requests' validated ``sources`` padded to
        ``bs``; return the device operations issued (as :func:`populate`)."""
        plan = self._plans.get((raw_bs, bs))
        if plan is None:
            plan = self._plans[(raw_bs, bs)] = plan_for(self.buffers, raw_bs, bs)
        return _write_planned(plan, sources)


def _write_planned(plan: _Plan, sources: Sequence[torch.Tensor]) -> int:
    # Without grad, an input with autograd history (hidden states from a
    # grad-enabled forward) is copied as data instead of failing halfway through
    # the writes. Replay already runs under no_grad: skip the ~2 us context then.
    if torch.is_grad_enabled():
        with torch.no_grad():
            _write(plan, sources)
    else:
        _write(plan, sources)
    return plan.device_ops


def _write(plan: _Plan, sources: Sequence[torch.Tensor]) -> None:
    # A host source is copied as torch copies it without blocking: from
    # pageable memory the call returns once the bytes are staged; from pinned
    # memory the copy runs later on the stream, so the caller must not rewrite
    # a pinned source before the step has run (the fused writers copy host
    # sources into their own ring instead, and have no such rule).
    for group in plan.copies:
        srcs = [sources[i] for i in group.index]
        srcs.extend(group.pads)
        torch._foreach_copy_(group.dsts, srcs, non_blocking=True)
    for live in plan.gathers:  # after the copies, on the same stream
        resolve_futures(live, plan.future)


def resolve_futures(ids: torch.Tensor, future: torch.Tensor | None) -> None:
    """Replace every future reference ``-r`` in ``ids`` by ``future[r]``, in place."""
    assert future is not None  # a plan has gathers only with a future map
    rows = ids.neg().clamp_(min=0)
    torch.where(ids < 0, future.index_select(0, rows), ids, out=ids)


def check_inputs(buffers: StaticBuffers, inputs: object, raw_bs: int) -> None:
    """Validate ``inputs`` for ``raw_bs`` live rows as :func:`populate` would,
    without writing anything: the eager fallback, whose batch is larger than
    the buffers (or of another width), runs the same checks; a field of several
    rows per request may hold any whole number of rows per request there."""
    for spec in buffers.specs:
        multi = spec.rows_per_request > 1
        _source(spec, inputs, spec.rows(raw_bs), buffers.device_of(spec), any_width=multi)
