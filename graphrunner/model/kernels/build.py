"""A kernel body made launchable: compiled by Triton, or run by its interpreter.

The kernels here are plain functions over ``triton.language``; a launch on
CUDA tensors compiles them, one on CPU tensors (or under ``TRITON_INTERPRET``)
runs them in Triton's interpreter, which is how CI checks them against their
torch references. Without the ``[cuda]`` extra the error names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphrunner.util.extras import needs_extra

__all__ = ["jit_or_interpret", "pow2_at_least"]


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of 2 that is ``>= n`` and ``>= floor`` (a block size)."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def jit_or_interpret(fn: Callable[..., None], interpret: bool, what: str) -> Any:
    """``fn`` as Triton's interpreter runs it (``interpret``) or jitted; a
    missing Triton raises the ``[cuda]`` extra's error naming ``what``."""
    with needs_extra("cuda", what):
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            return InterpretedFunction(fn)
        import triton

        return triton.jit(fn)
