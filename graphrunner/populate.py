"""The one routine that writes static buffers: live rows copied, padded rows
set by each buffer's declared :class:`~graphrunner.buffers.PadRule`.

No other code in graphrunner writes a pad value. Populate is graph-safe host
code: it allocates no device memory, reads nothing back from the device, and
walks the declared fields once.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from graphrunner.buffers import BufferSpec, StaticBuffers

__all__ = ["PopulateError", "populate"]


class PopulateError(ValueError):
    """An input does not match its declared buffer (names the field)."""


def _source(spec: BufferSpec, inputs: object, rows: int, device: torch.device) -> torch.Tensor:
    src = getattr(inputs, spec.name, None)
    if src is None:
        raise PopulateError(f"input {spec.name!r} is missing from {type(inputs).__name__}")
    if not isinstance(src, torch.Tensor):
        raise PopulateError(f"input {spec.name!r} must be a torch.Tensor, got {type(src).__name__}")
    if src.dtype != spec.dtype:
        raise PopulateError(f"input {spec.name!r} has dtype {src.dtype}, expected {spec.dtype}")
    if src.device != device:
        raise PopulateError(f"input {spec.name!r} is on {src.device}, expected {device}")
    expected = (rows, *spec.extra_shape)
    if tuple(src.shape) != expected:
        raise PopulateError(
            f"input {spec.name!r} has shape {tuple(src.shape)}, expected {expected} "
            f"(length must be the live rows)"
        )
    return src


def populate(buffers: StaticBuffers, inputs: object | None, raw_bs: int, bs: int) -> int:
    """Copy ``raw_bs`` live requests from ``inputs`` into the head of every
    buffer and apply each pad rule to rows ``[raw_bs:bs]`` only.

    Args:
        buffers: the runner's static buffers.
        inputs: any object with one tensor attribute per declared buffer, of
            ``raw_bs`` rows (``raw_bs * tokens_per_row`` for per-token
            buffers); may be None only when ``raw_bs == 0`` (capture writes an
            all-padding batch this way).
        raw_bs: live requests.
        bs: the captured size replayed, ``raw_bs <= bs <= max_bs``.

    Returns:
        The number of device operations issued (copies are grouped by dtype
        into one ``torch._foreach_copy_`` each; zero tails into one
        ``torch._foreach_zero_`` per dtype; fills one per buffer).
    """
    if not 0 <= raw_bs <= bs <= buffers.max_bs:
        raise PopulateError(
            f"need 0 <= raw_bs <= bs <= max_bs, got raw_bs={raw_bs}, bs={bs}, "
            f"max_bs={buffers.max_bs}"
        )
    if inputs is None and raw_bs:
        raise PopulateError(f"inputs are required for raw_bs={raw_bs} > 0")
    copies: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(
        lambda: ([], [])
    )
    zeros: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    fills: list[tuple[torch.Tensor, int | float]] = []
    for spec in buffers.specs:
        buf = buffers.tensors[spec.name]
        live, total = buffers.rows(spec, raw_bs), buffers.rows(spec, bs)
        if raw_bs:
            dsts, srcs = copies[spec.dtype]
            dsts.append(buf[:live])
            srcs.append(_source(spec, inputs, live, buffers.device))
        value = spec.pad_value(buffers.tokens_per_row)
        if total == live or value is None:
            continue
        if value == 0:
            zeros[spec.dtype].append(buf[live:total])
        else:
            fills.append((buf[live:total], value))
    for dsts, srcs in copies.values():
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
    for tails in zeros.values():
        torch._foreach_zero_(tails)
    for tail, value in fills:
        tail.fill_(value)
    return len(copies) + len(zeros) + len(fills)
