"""Static buffers of one layout share one allocation, a buffer per row.

Buffers alike in device, dtype, rows per request and row shape (the decode
fields: five int64 ``[max_bs]`` buffers) are rows ``0..n-1`` of one
``[n, rows(max_bs), *extra_shape]`` tensor (on the CPU, host buffers such as
``seq_lens_cpu`` join them). Each buffer stays a contiguous
tensor of its own shape at a fixed address, so a forward, a graph and a
kernel see no difference; populate gains a single staged write per pack: the
live rows and padded tails of every member in one ``torch.cat`` (see
:mod:`graphrunner.writers.base`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

__all__ = ["BufferPack", "PackedSpec", "allocate_packed"]


class PackedSpec(Protocol):
    """What packing reads of a buffer declaration (a
    :class:`~graphrunner.declare.buffers.BufferSpec`)."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def rows_per_request(self) -> int: ...
    @property
    def extra_shape(self) -> tuple[int, ...]: ...
    @property
    def axis(self) -> object: ...
    def rows(self, bs: Any) -> int: ...


Spec = TypeVar("Spec", bound=PackedSpec)


@dataclass(frozen=True, slots=True)
class BufferPack:
    """Buffers sharing one allocation.

    Attributes:
        names: the member buffers, in declaration order (row ``i`` is ``names[i]``).
        storage: ``[len(names), rows_per_request * max_bs, *extra_shape]``.
        rows_per_request: the members' rows per request.
    """

    names: tuple[str, ...]
    storage: torch.Tensor
    rows_per_request: int


def allocate_packed(
    specs: Sequence[Spec], max_bs: Any, device_of: Callable[[Spec], torch.device]
) -> tuple[dict[str, torch.Tensor], tuple[BufferPack, ...]]:
    """One zeroed allocation per layout; every spec's buffer a row of its
    pack. Returns the buffers by name (declaration order) and the packs."""
    layouts: dict[tuple[object, ...], list[Spec]] = {}
    for spec in specs:
        key = (device_of(spec), spec.dtype, spec.axis, spec.rows_per_request, spec.extra_shape)
        layouts.setdefault(key, []).append(spec)
    rows: dict[str, torch.Tensor] = {}
    packs = []
    for members in layouts.values():
        first = members[0]
        shape = (len(members), first.rows(max_bs), *first.extra_shape)
        storage = torch.zeros(shape, dtype=first.dtype, device=device_of(first))
        for i, spec in enumerate(members):
            rows[spec.name] = storage[i]
        packs.append(BufferPack(tuple(s.name for s in members), storage, first.rows_per_request))
    return {s.name: rows[s.name] for s in specs}, tuple(packs)
