"""Validation once: a replay's inputs are checked where they are made, or
fully on their first replay, and only cheaply after.

* Inputs that satisfy :class:`~graphrunner.declare.sealed.SealedInputs` (the
  decode batch, which validates its tensors when it builds them) and are
  *sealed*, on the buffers' device, skip the per-field checks; a sealed batch
  naming what it was checked against (a ``SpecBatch``'s ``seal_key``), where
  that covers these buffers (decided once per key).
* Any other object (a foreign ``DecodeInputs``) is checked in full on its
  first replay; the tensors it held then are remembered (weakly), and a later
  replay whose fields are those very tensors, at the same batch size, skips
  the checks. A field replaced by another tensor is checked in full again.
* A runner with a sanitizer checks everything on every replay.

The backend's own validation (:meth:`GraphBackend.validate_inputs`, host
values that change every step) runs on every replay. What the cheap path
cannot see is an in-place change of a remembered tensor's values (a host
mirror's row set to 0): that is what the sanitizer is for.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from operator import attrgetter

import torch

from graphrunner.declare.buffers import Axis, BufferSpec, Size, StaticBuffers, units
from graphrunner.declare.decode import DECODE_FIELD_NAMES, DECODE_HOST_MIRRORS, REQ_POOL_INDICES
from graphrunner.declare.hooks import GraphBackend, NullBackend
from graphrunner.declare.inputs import StepInputs
from graphrunner.declare.sealed import (
    SealKey,
    host_min_max,
    is_keyed_type,
    is_sealed_inputs,
    is_sealed_type,
    layout,
)
from graphrunner.sampling import SAMPLING_FIELDS
from graphrunner.writers.base import PopulateError, check_sources

__all__ = ["InputGate", "check_host_mirrors", "host_range"]

_MIRRORS = tuple(DECODE_HOST_MIRRORS.values())
_KEYED = "keyed"  # a type whose seal names its key (InputGate._seal_kind)


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


def _batch_made(spec: BufferSpec) -> bool:
    """A sealed decode batch builds this buffer's input itself: an int64 ``[bs]``
    device field, or a host mirror declared as a host buffer; or it is a
    sampling row, made and checked by ``sampling_tensors`` as declared."""
    if spec in SAMPLING_FIELDS:
        return True
    plain = spec.dtype == torch.int64 and spec.rows_per_request == 1 and not spec.extra_shape
    placed = spec.name in DECODE_FIELD_NAMES if not spec.host else spec.name in _MIRRORS
    return plain and placed


class InputGate:
    """Checks one runner's replay inputs (see the module docstring); each
    :class:`~graphrunner.GraphRunner` owns one (``runner.input_gate``).

    Args:
        buffers: the runner's static buffers (the declarations checked against).
    """

    def __init__(self, buffers: StaticBuffers) -> None:
        self.buffers = buffers
        self._names = tuple(s.name for s in buffers.specs)
        # The declared fields of an inputs object, in order, in one call.
        self._fields = _fields_getter(self._names)
        self._watched = (*self._names, *(m for m in _MIRRORS if m not in self._names))
        self._batch_made = all(_batch_made(s) for s in buffers.specs)
        self._seen: list[weakref.ref[torch.Tensor] | None] = []
        self._seen_bs: Size = -1
        # Per type: True (a sealed batch making exactly these buffers), _KEYED, or False.
        self._sealed_types: dict[type, bool | str] = {}
        self._layout = frozenset(layout(s) for s in buffers.specs)
        self._covers: dict[SealKey | None, bool] = {}  # per seal key: whether it covers ours
        self.device = buffers.device
        #: Full checks run (a test and the bench read it).
        self.full_checks = 0

    def sources(
        self, inputs: StepInputs, raw_bs: Size, backend: GraphBackend, *, full: bool = False
    ) -> Sequence[torch.Tensor]:
        """The inputs' tensors, one per declared buffer, validated: in full on
        ``full`` or first sight, else by identity. Raises before anything is
        written; the backend's own check runs every time."""
        validates = type(backend) is not NullBackend  # the no-op one is not called
        if not full:
            kind = type(inputs)
            sealed = self._sealed_types.get(kind)
            if sealed is None:
                sealed = self._sealed_types[kind] = self._seal_kind(kind)
            if (
                sealed is True and _is_sealed_now(inputs) and inputs.device == self.device  # type: ignore[attr-defined]
            ) or (sealed is _KEYED and inputs.sealed and self._covered(inputs.seal_key)):  # type: ignore[attr-defined]
                if validates:
                    backend.validate_inputs(raw_bs, inputs)
                return self._fields(inputs)
            if raw_bs == self._seen_bs and self._same(inputs):
                if validates:
                    backend.validate_inputs(raw_bs, inputs)
                return self._fields(inputs)
        check_host_mirrors(inputs, raw_bs)
        backend.validate_inputs(raw_bs, inputs)
        sources = check_sources(self.buffers, inputs, raw_bs)
        self.full_checks += 1
        if not full:
            self._remember(inputs, raw_bs)
        return sources

    def _seal_kind(self, kind: type) -> bool | str:
        """How a sealed ``kind`` is trusted: for its key (_KEYED), as making
        every one of these buffers itself (True), or not (False)."""
        return _KEYED if is_keyed_type(kind) else self._batch_made and is_sealed_type(kind)

    def _covered(self, key: SealKey | None) -> bool:
        """Whether a seal of ``key`` checked every one of these buffers'
        layouts on their device (decided once per key)."""
        known = self._covers.get(key)
        if known is None:
            fits = key is not None and key.device == self.device and self._layout <= key.fields
            known = self._covers[key] = fits
        return known

    def _same(self, inputs: object) -> bool:
        for name, ref in zip(self._watched, self._seen, strict=True):
            value = getattr(inputs, name, None)
            if (None if ref is None else ref()) is not value:
                return False
        return True

    def _remember(self, inputs: object, raw_bs: Size) -> None:
        seen: list[weakref.ref[torch.Tensor] | None] = []
        for name in self._watched:
            value = getattr(inputs, name, None)
            seen.append(weakref.ref(value) if isinstance(value, torch.Tensor) else None)
        self._seen, self._seen_bs = seen, raw_bs


def host_range(inputs: object, name: str, values: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of host mirror ``values`` (``inputs.<name>``), None when
    empty: :class:`~graphrunner.declare.sealed.SealedInputs` answer from what
    they knew when they made the mirror (a lookup); any other inputs object
    pays one host ``aminmax``."""
    if is_sealed_inputs(inputs):
        return inputs.host_range(name)
    return host_min_max(values)


def _fields_getter(names: tuple[str, ...]) -> Callable[[object], Sequence[torch.Tensor]]:
    if len(names) == 1:
        only = names[0]
        return lambda inputs: (getattr(inputs, only),)
    return attrgetter(*names)


def _is_sealed_now(inputs: object) -> bool:
    # The attribute where the batch keeps one (no call), else the protocol's method.
    sealed = getattr(inputs, "sealed", None)
    return inputs.is_sealed() if sealed is None else sealed  # type: ignore[attr-defined]
