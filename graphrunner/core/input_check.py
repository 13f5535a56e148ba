"""Validation once: a replay's inputs are checked where they are made, and
only cheaply after.

* A sealed step (:mod:`graphrunner.declare.sealed`: a ``DecodeBatch`` or a
  ``SpecBatch``, unchanged since its own last operation checked it) whose
  ``seal_key`` covers these buffers on their device costs two dict lookups
  (each type and key decided once). The seal must be the type's own: a
  wrapper that hands a batch's attributes through (``__getattr__``) may
  hold fields the seal never saw, and is checked in full.
* Anything else (an unsealed batch, an engine's own object with the fields as
  attributes) is checked in full, on every replay.
* A runner with a sanitizer checks everything on every replay.

The backend's own validation (:meth:`GraphBackend.validate_inputs`, host
values that change every step) runs on every replay. What the cheap path
cannot see is an in-place change of a sealed step's values (a host mirror's
row set to 0): that is what the sanitizer is for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import torch

from graphrunner.declare.buffers import Axis, Size, StaticBuffers, units
from graphrunner.declare.decode import DECODE_HOST_MIRRORS, REQ_POOL_INDICES
from graphrunner.declare.hooks import GraphBackend, NullBackend
from graphrunner.declare.inputs import StepInputs
from graphrunner.declare.sealed import SealKey, cached_range, host_min_max, layout
from graphrunner.writers.base import PopulateError, check_sources

__all__ = ["InputGate", "check_host_mirrors", "host_range"]

_MIRRORS = tuple(DECODE_HOST_MIRRORS.values())


def check_host_mirrors(inputs: object, size: Size) -> None:
    """The host mirrors ``inputs`` carries are CPU int64 ``[raw_bs]`` tensors
    (``raw_bs`` the step's live requests), request rows >= 1: what can be
    checked on the host at no device cost (the backend checks its ranges; the
    sanitizer checks the device values)."""
    raw_bs = units(Axis.REQUEST, size)
    for name in _MIRRORS:
        mirror = getattr(inputs, name, None)
        if mirror is None:
            continue
        if not isinstance(mirror, torch.Tensor):
            raise PopulateError(
                f"host mirror {name!r} is a {type(mirror).__name__}; expected a CPU "
                f"int64 tensor of shape ({raw_bs},)"
            )
        if mirror.device.type != "cpu" or mirror.dtype != torch.int64 or mirror.shape != (raw_bs,):
            raise PopulateError(
                f"host mirror {name!r} is {mirror.dtype} {tuple(mirror.shape)} on "
                f"{mirror.device}; expected a CPU int64 tensor of shape ({raw_bs},)"
            )
    rows = getattr(inputs, DECODE_HOST_MIRRORS[REQ_POOL_INDICES], None)
    if rows is not None and raw_bs and int(rows.min()) < 1:
        row = int((rows < 1).nonzero()[0, 0])
        raise PopulateError(
            f"req_pool_indices_cpu[{row}]={int(rows[row])}: expected >= 1 (0 is the padding row)"
        )


class InputGate:
    """Checks one runner's replay inputs (see the module docstring); each
    :class:`~graphrunner.GraphRunner` owns one (``runner.input_gate``).

    Args:
        buffers: the runner's static buffers (the declarations checked against).
    """

    def __init__(self, buffers: StaticBuffers) -> None:
        self.buffers = buffers
        # The declared fields of an inputs object, in order, in one call.
        self._fields = _fields_getter(tuple(s.name for s in buffers.specs))
        self._layout = frozenset(layout(s) for s in buffers.specs)
        self._covers: dict[SealKey | None, bool] = {}  # per seal key: whether it covers ours
        self._keyed: dict[type, bool] = {}  # per type: whether it carries a seal of its own
        self.device = buffers.device
        #: Full checks run (a test and the bench read it).
        self.full_checks = 0

    def sources(
        self, inputs: StepInputs, raw_bs: Size, backend: GraphBackend, *, full: bool = False
    ) -> Sequence[torch.Tensor]:
        """The inputs' tensors, one per declared buffer, validated: by their
        seal, or in full (``full``, or no seal covering these buffers). Raises
        before anything is written; the backend's own check runs every time."""
        kind = type(inputs)
        keyed = self._keyed.get(kind)
        if keyed is None:  # a seal of the type's own, not one a wrapper delegates to its base
            keyed = self._keyed[kind] = hasattr(kind, "seal_key")
        if not full and keyed and inputs.sealed:  # type: ignore[attr-defined]
            key = inputs.seal_key  # type: ignore[attr-defined]
            covered = self._covers.get(key)  # the method only on a key's first sight
            if covered or (covered is None and self._covered(key)):
                if type(backend) is not NullBackend:  # the no-op one is not called
                    backend.validate_inputs(raw_bs, inputs)
                return self._fields(inputs)
        check_host_mirrors(inputs, raw_bs)
        backend.validate_inputs(raw_bs, inputs)
        sources = check_sources(self.buffers, inputs, raw_bs)
        self.full_checks += 1
        return sources

    def _covered(self, key: SealKey | None) -> bool:
        """Whether a seal of ``key`` checked every one of these buffers'
        layouts on their device (decided once per key)."""
        known = self._covers.get(key)
        if known is None:
            fits = key is not None and key.device == self.device and self._layout <= key.fields
            known = self._covers[key] = fits
        return known


def host_range(inputs: object, name: str, values: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of host mirror ``values`` (``inputs.<name>``), None when
    empty: a sealed step answers from what it knew when it made the mirror
    (its ``host_ranges``, a lookup); any other inputs object pays one host
    ``aminmax``."""
    known = getattr(inputs, "host_ranges", None)
    if known is not None:
        return cached_range(known, name, values)
    return host_min_max(values)


def _fields_getter(names: tuple[str, ...]) -> Callable[[object], Sequence[torch.Tensor]]:
    if len(names) == 1:
        only = names[0]
        return lambda inputs: (getattr(inputs, only),)
    return attrgetter(*names)
