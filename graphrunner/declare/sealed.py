"""A step validated where it was made: its seal.

A step value that builds and checks its own tensors (a
:class:`~graphrunner.DecodeBatch` at construction, ``prepare_decode``,
``filter`` and ``merge``; a :class:`~graphrunner.phases.SpecBatch` at
:meth:`~graphrunner.phases.SpecBatch.seal` or as a builder makes it) carries
three plain attributes, read by a replay without a call:

* ``sealed``: True while every field is the tensor its own last operation
  made and checked (any assignment from outside clears it);
* ``seal_key``: what it was checked against (:func:`seal_key`: the layouts of
  the buffers it vouches for, and the device), compared by a runner with its
  own buffers once per key;
* ``host_ranges``: what it knows of its host mirrors' ``(min, max)``
  (:func:`cached_range`), so a backend's range check is a lookup.

Anything else handed to a replay is checked in full, every time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from graphrunner.declare.buffers import BufferSpec

__all__ = ["VERSION", "HostRanges", "SealKey", "cached_range", "host_min_max", "known_ranges"]
__all__ += ["layout", "seal_key", "widened"]

#: torch's version-counter descriptor: ``VERSION.__get__(t)`` reads ``t``'s
#: counter in C (no Python frame on a replay's path).
VERSION = vars(torch._C.TensorBase)["_version"]


def host_min_max(values: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of a host int tensor (no device sync), None when empty."""
    if not values.numel():
        return None
    low, high = values.aminmax()
    return int(low), int(high)


#: A step's known mirror ranges: name -> (mirror, its version then, min, max).
HostRanges = dict[str, tuple[torch.Tensor, int, int, int]]


def known_ranges(batch: object, ranges: dict[str, tuple[int, int]]) -> HostRanges:
    """``ranges`` (mirror name -> (min, max)) tied to ``batch``'s mirrors as they are now."""
    return {n: (m := getattr(batch, n), VERSION.__get__(m), *r) for n, r in ranges.items()}


def cached_range(known: HostRanges, name: str, mirror: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of host mirror ``name``, None when empty: from ``known``
    while its entry is this tensor unchanged in place (its version), else computed and kept."""
    entry = known.get(name)
    if entry is not None and entry[0] is mirror and entry[1] == VERSION.__get__(mirror):
        return entry[2], entry[3]
    bounds = host_min_max(mirror)
    if bounds is not None:
        known[name] = (mirror, VERSION.__get__(mirror), *bounds)
    return bounds


def layout(spec: BufferSpec) -> tuple[object, ...]:
    """What an input check reads of ``spec``: specs of one layout accept the same tensors."""
    return (spec.name, spec.dtype, spec.host, spec.axis, spec.rows_per_request, spec.extra_shape)


class SealKey(NamedTuple):
    """What a seal vouches for: fields of these :func:`layout` s on ``device``."""

    fields: frozenset[tuple[object, ...]]
    device: torch.device


_keys: dict[SealKey, SealKey] = {}


def _interned(key: SealKey) -> SealKey:
    # Equal keys are one object, so a runner decides each once (a dict by identity-hash).
    return _keys.setdefault(key, key)


def seal_key(specs: Iterable[BufferSpec], device: torch.device) -> SealKey:
    """The key of ``specs`` checked on ``device``, interned (equal keys are one object)."""
    return _interned(SealKey(frozenset(layout(s) for s in specs), device))


def widened(key: SealKey, specs: Iterable[BufferSpec]) -> SealKey:
    """``key`` vouching for ``specs`` too (a step grown by fields checked on its device)."""
    return _interned(SealKey(key.fields | {layout(s) for s in specs}, key.device))
