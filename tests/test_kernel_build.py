"""kernels/build.py: block sizes and the interpreter's scalar index under NumPy >= 2.4."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest

from graphrunner_ref.model.kernels import build
from graphrunner_ref.model.kernels.build import pow2_at_least


@pytest.mark.parametrize(
    ("n", "floor", "want"), [(1, 1, 1), (3, 1, 4), (16, 1, 16), (17, 1, 32), (2, 16, 16)]
)
def test_pow2_at_least(n: int, floor: int, want: int) -> None:
    assert pow2_at_least(n, floor) == want


class _Scope:
    """The interpreter's patch scope: records each attribute it replaces."""

    def __init__(self) -> None:
        self.changes: list[tuple[object, str, object]] = []

    def set_attr(self, obj: object, name: str, value: object) -> None:
        self.changes.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)

    def restore(self) -> None:
        while self.changes:
            obj, name, old = self.changes.pop()
            setattr(obj, name, old)


class _Handle:
    def __init__(self, data: np.ndarray) -> None:
        self.data = data


def _old_interpreter() -> Any:
    """A module shaped like Triton 3.6's interpreter: ``int()`` of the
    scalar's one-element array, which NumPy >= 2.4 refuses."""

    def patch_lang_tensor(tensor: type, scope: _Scope) -> None:
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(1)[0:1]))
        scope.set_attr(tensor, "marker", "kept")

    return types.SimpleNamespace(_patch_lang_tensor=patch_lang_tensor)


def test_a_scalar_tensor_indexes_after_the_patch_and_restores() -> None:
    class Tensor:
        def __init__(self, value: int) -> None:
            self.handle = _Handle(np.array([value], dtype=np.int32))

    interpreter = _old_interpreter()
    build._squeeze_scalar_index(interpreter)
    build._squeeze_scalar_index(interpreter)  # once only: the second call keeps the first wrap
    scope = _Scope()
    interpreter._patch_lang_tensor(Tensor, scope)
    assert list(range(0, Tensor(7), 3)) == [0, 3, 6]  # type: ignore[call-overload]
    assert Tensor.marker == "kept"  # type: ignore[attr-defined]  # the original patch still ran
    scope.restore()
    assert Tensor.__index__ is None  # type: ignore[attr-defined]  # the scope undid both


def test_an_interpreter_without_the_hook_is_left_alone() -> None:
    interpreter = types.SimpleNamespace()
    build._squeeze_scalar_index(interpreter)
    assert not vars(interpreter)
