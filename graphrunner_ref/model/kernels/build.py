"""A kernel body made launchable: compiled by Triton, or run by its interpreter.

The kernels here are plain functions over ``triton.language``; a launch on
CUDA tensors compiles them, one on CPU tensors (or under ``TRITON_INTERPRET``)
runs them in Triton's interpreter, which is how CI checks them against their
torch references. Without the ``[cuda]`` extra the error names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphrunner.util import needs_extra

__all__ = ["jit_or_interpret", "pow2_at_least"]


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of 2 that is ``>= n`` and ``>= floor`` (a block size)."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def jit_or_interpret(fn: Callable[..., None], interpret: bool, what: str) -> Any:
    """``fn`` as Triton's interpreter runs it (``interpret``) or jitted; a
    missing Triton raises the ``[cuda]`` extra's error naming ``what``."""
    with needs_extra("cuda", what):
        if interpret:
            from triton.runtime import interpreter

            _squeeze_scalar_index(interpreter)
            return interpreter.InterpretedFunction(fn)
        import triton

        return triton.jit(fn)


def _squeeze_scalar_index(interpreter: Any) -> None:
    """Let the interpreter index with a scalar tensor under NumPy >= 2.4.

    A loop bound that is a kernel argument (``range(0, K, BLOCK)``) reaches
    ``int()`` as the interpreter's one-element array; Triton 3.6 (torch
    2.11's) converts it with ``int(data)``, which NumPy 2.4 refuses for an
    array of one dimension. Later Triton squeezes it first; this does the
    same for the older one, patching nothing where the hook is absent.
    """
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_scalars", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        patch_tensor(tensor, scope)
        # Recorded in the same scope, so the launch's restore undoes it too.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_scalars = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
