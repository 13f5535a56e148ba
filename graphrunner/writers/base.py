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

from collections.abc import Sequence

import torch

from graphrunner.declare.buffers import BufferSpec, Size, StaticBuffers, has_rows, place
from graphrunner.writers.plan import CopyGroup, Plan, PopulateError, plan_for

__all__ = [
    "PopulateError",
    "TorchWriter",
    "check_fields",
    "check_inputs",
    "check_sources",
    "populate",
    "resolve_futures",
    "write_sources",
]


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


def check_sources(buffers: StaticBuffers, inputs: object, raw_bs: Size) -> list[torch.Tensor]:
    """Every declared input of ``inputs`` for ``raw_bs >= 1`` live requests,
    validated (present, a tensor, dtype, device, ``[spec.rows(raw_bs),
    *extra_shape]``), in the order of ``buffers.specs``. The device is the
    buffer's, or the host for a buffer that
    :attr:`~graphrunner.declare.buffers.BufferSpec.takes_host_source`."""
    return check_fields(buffers.specs, buffers.device, inputs, raw_bs)


def check_fields(
    specs: Sequence[BufferSpec], device: torch.device, inputs: object, raw_bs: Size
) -> list[torch.Tensor]:
    """:func:`check_sources` against ``specs`` on ``device`` (no buffers
    needed: a batch sealing itself checks this way)."""
    return [_source(spec, inputs, spec.rows(raw_bs), place(spec, device)) for spec in specs]


def populate(buffers: StaticBuffers, inputs: object | None, raw_bs: Size, bs: Size) -> int:
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
        The number of operations issued (:mod:`graphrunner.writers.plan`):
        on the CPU, one ``torch.cat`` per pack of buffers sharing an
        allocation (plus one copy out of staging below the largest size);
        one ``torch._foreach_copy_`` per (device, dtype) for the rest, writing
        the live rows and the padded tails (from precomputed rows of each pad
        value) at once, host buffers' included; one resolve per future
        buffer. Every input is validated before anything is written.
    """
    if inputs is None and has_rows(raw_bs):
        raise PopulateError(f"inputs are required for raw_bs={raw_bs} > 0")
    plan = plan_for(buffers, raw_bs, bs)  # size errors before input errors
    sources = check_sources(buffers, inputs, raw_bs) if has_rows(raw_bs) else []
    return _write_planned(plan, sources)


def write_sources(
    buffers: StaticBuffers,
    sources: Sequence[torch.Tensor],
    raw_bs: Size,
    bs: Size,
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
        self._plans: dict[tuple[Size, Size], Plan] = {}

    def write(self, sources: Sequence[torch.Tensor], raw_bs: Size, bs: Size) -> int:
        """Write ``raw_bs`` live requests' validated ``sources`` padded to
        ``bs``; return the device operations issued (as :func:`populate`)."""
        plan = self._plans.get((raw_bs, bs))
        if plan is None:
            plan = self._plans[(raw_bs, bs)] = plan_for(self.buffers, raw_bs, bs)
        return _write_planned(plan, sources)


def _write_planned(plan: Plan, sources: Sequence[torch.Tensor]) -> int:
    # Without grad, an input with autograd history (hidden states from a
    # grad-enabled forward) is copied as data instead of failing halfway
    # through the writes. Replay already runs under no_grad: no switch then.
    # A host source is copied as torch copies it without blocking: from
    # pageable memory the call returns once the bytes are staged; from pinned
    # memory the copy runs later on the stream, so the caller must not rewrite
    # a pinned source before the step has run (the fused writers copy host
    # sources into their own ring instead, and have no such rule).
    grad = torch.is_grad_enabled()
    if grad:
        torch.set_grad_enabled(False)
    try:
        for pack in plan.staged:  # each pack in one ``cat`` (and one copy out of staging)
            parts = pack.parts
            if pack.take is not None:
                parts = parts.copy()
                parts[pack.live] = pack.take(sources)
            torch.cat(parts, out=pack.out)
            if pack.dst is not None:
                pack.dst[0].copy_(pack.dst[1])
        for group in plan.copies:
            _copy(group, sources)
        for live in plan.gathers:  # after the copies, on the same stream
            resolve_futures(live, plan.future)
    finally:
        if grad:
            torch.set_grad_enabled(True)
    return plan.device_ops


def _copy(group: CopyGroup, sources: Sequence[torch.Tensor]) -> None:
    srcs = [sources[i] for i in group.index]
    srcs.extend(group.pads)
    torch._foreach_copy_(group.dsts, srcs, non_blocking=True)


def resolve_futures(ids: torch.Tensor, future: torch.Tensor | None) -> None:
    """Replace every future reference ``-r`` in ``ids`` by ``future[r]``, in place."""
    assert future is not None  # a plan has gathers only with a future map
    rows = ids.neg().clamp_(min=0)
    torch.where(ids < 0, future.index_select(0, rows), ids, out=ids)


def check_inputs(buffers: StaticBuffers, inputs: object, raw_bs: Size) -> None:
    """Validate ``inputs`` for ``raw_bs`` live rows as :func:`populate` would,
    without writing anything: the eager fallback, whose batch is larger than
    the buffers (or of another width), runs the same checks; a field of several
    rows per request may hold any whole number of rows per request there."""
    for spec in buffers.specs:
        multi = spec.rows_per_request > 1
        _source(spec, inputs, spec.rows(raw_bs), buffers.device_of(spec), any_width=multi)
