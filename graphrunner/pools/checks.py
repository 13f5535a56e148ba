"""The one argument check of the pools and the batch: every refusal names the
entry point, the argument, its value (a tensor by its metadata only) and what
was expected — ``"free: indices=3 (int); expected a sequence of ints ..."`` —
as a ``TypeError`` for a wrong type and a ``ValueError`` subclass (``PoolError``,
``BatchError``) for a wrong value, raised before anything is changed.
"""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch

from graphrunner.pools.errors import InvalidSlot, PoolError

__all__ = [
    "DeviceLike",
    "SlotIndices",
    "as_index_list",
    "bad_arg",
    "check_count",
    "check_device",
    "check_each",
    "check_float_dtype",
    "check_int",
    "check_tensor",
    "describe",
    "first_repeat",
    "host_int",
    "same_device",
]

DeviceLike: TypeAlias = "torch.device | str"
SlotIndices: TypeAlias = "Sequence[int] | torch.Tensor"
#: What an index argument may be, for messages.
_INDEX_LIST = "a sequence of ints (or a 1-D integer CPU tensor)"


class _Repr(reprlib.Repr):
    """Short reprs; a tensor by shape, dtype and device (its values may be on a device)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring, self.maxother = 40, 60

    def repr1(self, x: object, level: int) -> str:
        if isinstance(x, torch.Tensor):
            return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
        return super().repr1(x, level)


_REPR = _Repr()


def describe(value: object) -> str:
    """``value`` and its type for a message, never reading a tensor's values."""
    return f"{_REPR.repr(value)} ({type(value).__name__})"


def bad_arg(
    name: str, value: object, expected: str, error: type[Exception] = TypeError
) -> Exception:
    """The refusal of argument ``name``: ``error("name=value (type); expected ...")``."""
    return error(f"{name}={describe(value)}; expected {expected}")


def host_int(value: object) -> int | None:
    """``value`` as an int if it is a Python or NumPy integer, else None.

    bool is refused (``True`` is not an index), and so are tensors and arrays: a
    tensor has ``__index__`` too, but reading it may be a device→host sync.
    """
    if type(value) is int:  # the common case, and plain for torch.compile
        return value
    if isinstance(value, (bool, np.bool_, torch.Tensor, np.ndarray)):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_int(name: str, value: object, what: str = "an int") -> int:
    """``value`` as an int (Python or NumPy); ``TypeError`` naming ``name`` otherwise."""
    n = host_int(value)
    if n is None:
        raise bad_arg(name, value, what)
    return n


def check_count(
    name: str,
    value: object,
    minimum: int = 0,
    maximum: int | None = None,
    *,
    error: type[ValueError] = PoolError,
    what: str | None = None,
) -> int:
    """``value`` as an int in ``minimum..maximum``; else ``TypeError`` (not an int)
    or ``error`` (out of range), naming ``name`` and ``what`` was expected."""
    n = host_int(value)
    if n is not None and n >= minimum and (maximum is None or n <= maximum):
        return n
    if what is None:
        what = f"an int >= {minimum}" if maximum is None else f"an int in {minimum}..{maximum}"
    raise bad_arg(name, value, what, TypeError if n is None else error)


def check_each(
    name: str,
    values: list[int],
    minimum: int = 0,
    maximum: int | None = None,
    *,
    error: type[ValueError] = PoolError,
    what: str | None = None,
) -> None:
    """:func:`check_count` for every int of ``values``, naming the first bad one ``name[i]``."""
    if not values or (min(values) >= minimum and (maximum is None or max(values) <= maximum)):
        return  # the common case, without a name per element
    for i, v in enumerate(values):
        check_count(f"{name}[{i}]", v, minimum, maximum, error=error, what=what)


def as_index_list(
    indices: object,
    name: str,
    *,
    expected: str = _INDEX_LIST,
    error: type[ValueError] = InvalidSlot,
) -> list[int]:
    """Host ints from a sequence (or NumPy array) of Python or NumPy ints, or a 1-D
    integer CPU tensor; ``TypeError`` / ``error`` naming ``name`` otherwise.

    A tensor on another device is refused rather than read: reading it would be a
    device→host sync, which is exactly what the scheduler must never do per step.
    """
    if isinstance(indices, torch.Tensor):
        check_tensor(name, indices, dtype="integer", shape=(None,), devices=("cpu",), error=error)
        return [int(i) for i in indices.tolist()]
    if isinstance(indices, (str, bytes)) or not isinstance(indices, (Sequence, np.ndarray)):
        raise bad_arg(name, indices, expected)
    values = list(indices)
    if all(type(v) is int for v in values):  # the common case, without a name per element
        return values
    return [check_int(f"{name}[{i}]", v) for i, v in enumerate(values)]


def first_repeat(values: Sequence[object]) -> int:
    """The index of the first element that repeats an earlier one (-1: none does)."""
    seen: set[object] = set()
    for i, v in enumerate(values):
        if v in seen:
            return i
        seen.add(v)
    return -1


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device: ``cuda`` and ``cuda:0`` are, since an
    index is only compared when both have one."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_tensor(
    name: str,
    value: object,
    *,
    dtype: torch.dtype | str,
    shape: tuple[int | None, ...],
    devices: Sequence[DeviceLike],
    error: type[ValueError] = PoolError,
) -> torch.Tensor:
    """``value`` as a tensor of ``dtype`` (or ``"integer"``, ``"floating"``), ``shape``
    (None: any length) on one of ``devices``; reads metadata only, never values."""
    if not isinstance(value, torch.Tensor):
        raise bad_arg(name, value, _tensor_spec(dtype, shape, devices))
    ok_shape = value.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(value.shape, shape, strict=True)
    )
    ok_device = any(same_device(value.device, torch.device(d)) for d in devices)
    if not (_dtype_ok(value, dtype) and ok_shape and ok_device):
        raise bad_arg(name, value, _tensor_spec(dtype, shape, devices), error)
    return value


def _dtype_ok(t: torch.Tensor, dtype: torch.dtype | str) -> bool:
    if dtype == "floating":
        return t.is_floating_point()
    if dtype == "integer":
        return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
    return t.dtype == dtype


def _tensor_spec(
    dtype: torch.dtype | str, shape: tuple[int | None, ...], devices: Sequence[DeviceLike]
) -> str:
    dims = ", ".join("n" if d is None else str(d) for d in shape)
    dims = f"({dims},)" if len(shape) == 1 else f"({dims})"
    where = " or ".join(str(d) for d in devices)
    return f"a tensor of shape {dims} and dtype {dtype} on {where}"


def check_device(name: str, device: object, error: type[ValueError] = PoolError) -> torch.device:
    """``device`` (a ``torch.device`` or a string naming one) as a ``torch.device``."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise bad_arg(name, device, "a torch.device or a device string such as 'cpu'")
    try:
        return torch.device(device)
    except RuntimeError:
        raise bad_arg(name, device, "a device string such as 'cpu' or 'cuda:0'", error) from None


def check_float_dtype(name: str, dtype: object, error: type[ValueError] = PoolError) -> torch.dtype:
    """``dtype`` if it is a floating ``torch.dtype``."""
    what = "a floating torch.dtype"
    if not isinstance(dtype, torch.dtype):
        raise bad_arg(name, dtype, what)
    if not dtype.is_floating_point:
        raise bad_arg(name, dtype, what, error)
    return dtype
