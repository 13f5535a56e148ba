"""Inputs that were validated where they were made: the sealed-inputs protocol.

A batch that builds and checks its own tensors (the decode batch, at
construction, ``prepare_decode``, ``filter`` and ``merge``) can say so: while
:meth:`SealedInputs.is_sealed` is True, every field is the tensor its own last
operation made and validated, and :meth:`SealedInputs.host_range` answers a
host mirror's ``(min, max)`` from what it already knew. The replay path then
skips its per-field checks; it never asks which phase the batch belongs to.

Whether a type satisfies the protocol is decided once per type
(:func:`is_sealed_type`): an ``isinstance`` on a runtime-checkable protocol
costs microseconds a call, the cached lookup a dict access.
"""

from __future__ import annotations

from typing import Protocol, TypeGuard

import torch

__all__ = ["VERSION", "SealedInputs", "host_min_max", "is_sealed_inputs", "is_sealed_type"]


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
