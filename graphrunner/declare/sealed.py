"""Inputs that were validated where they were made: the sealed-inputs protocol.

A batch that builds and checks its own tensors (the decode batch, at
construction, ``prepare_decode``, ``filter`` and ``merge``) can say so: while
:meth:`SealedInputs.is_sealed` is True, every field is the tensor its own last
operation made and validated, and :meth:`SealedInputs.host_range` answers a
host mirror's ``(min, max)`` from what it already knew. The replay path then
skips its per-field checks; it never asks which phase the batch belongs to.

Whether a type satisfies the protocol is decided once per type
(:func:`is_sealed_type`): an ``isinstance`` on a runtime-checkable protocol
costs microseconds a call, the cached lookup a dict access. A batch whose
fields are not the decode batch's own (a ``SpecBatch``) names what it was
checked against: its ``seal_key`` (:func:`seal_key`), compared by a runner
with its buffers once per key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeGuard

import torch

if TYPE_CHECKING:
    from graphrunner.declare.buffers import BufferSpec

__all__ = ["VERSION", "SealKey", "SealedInputs", "cached_range", "host_min_max", "seal_key"]
__all__ += ["is_keyed_type", "is_sealed_inputs", "is_sealed_type", "known_ranges", "layout"]


class SealedInputs(Protocol):
    """Step inputs that know their own validity.

    Attributes:
        device: where its device tensors live (a sealed batch on another
            device than the runner's buffers is checked in full).
    """

    device: torch.device
    #: :meth:`is_sealed` as a plain attribute, which a replay reads without a call.
    sealed: bool

    def is_sealed(self) -> bool:
        """True while no field was assigned from outside since the batch's
        own last operation validated it."""
        ...

    def host_range(self, name: str) -> tuple[int, int] | None:
        """``(min, max)`` of host mirror ``name`` (a CPU int64 ``[bs]``
        tensor), None when it is empty; no device sync."""
        ...


#: torch's version-counter descriptor: ``VERSION.__get__(t)`` reads ``t``'s
#: counter in C (no Python frame on a replay's path).
VERSION = vars(torch._C.TensorBase)["_version"]

_METHODS = ("is_sealed", "host_range")
_decided: dict[type, bool] = {}


def is_sealed_type(cls: type) -> bool:
    """Whether instances of ``cls`` satisfy :class:`SealedInputs` (callable
    ``is_sealed`` and ``host_range``); decided once per type. Their
    ``device`` is read per call, where it is compared."""
    known = _decided.get(cls)
    if known is None:
        known = _decided[cls] = all(callable(getattr(cls, m, None)) for m in _METHODS)
    return known


def is_sealed_inputs(inputs: object) -> TypeGuard[SealedInputs]:
    """Whether ``inputs``'s type satisfies :class:`SealedInputs` (cached per type)."""
    return is_sealed_type(type(inputs))


def host_min_max(values: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of a host int tensor (no device sync), None when empty."""
    if not values.numel():
        return None
    low, high = values.aminmax()
    return int(low), int(high)


#: A batch's known mirror ranges: name -> (mirror, its version then, min, max).
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
    """What a keyed seal vouches for: fields of these :func:`layout` s on ``device``."""

    fields: frozenset[tuple[object, ...]]
    device: torch.device


_keys: dict[SealKey, SealKey] = {}


def seal_key(specs: Sequence[BufferSpec], device: torch.device) -> SealKey:
    """The key of ``specs`` checked on ``device``, interned (equal keys are one object)."""
    key = SealKey(frozenset(layout(s) for s in specs), device)
    return _keys.setdefault(key, key)


def is_keyed_type(cls: type) -> bool:
    """Whether ``cls``'s seal names its key (``seal_key``): trusted for that key only."""
    return hasattr(cls, "seal_key")
