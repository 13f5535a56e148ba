"""Skipping a sampled step's work that no live row needs, on the CPU.

A CUDA step is a device graph: it cannot branch, and runs every operation
for every row. A CPU step is a compiled program that can: :func:`unless`
runs the full operation only when some live row needs it (``torch.cond`` in
a compiled step, a plain ``if`` eagerly, where reading the flag costs
nothing), else a shortcut that gives the live rows the same values. The
sampler's vocabulary sort, the penalties, the ``min_tokens`` hold and the
grammar's bitmask each cost a pass over every row's vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["BranchFreeTrace", "branch_free", "unless"]


@dataclass
class BranchFreeTrace:
    """What a :func:`branch_free` trace met: ``gates``, the :func:`unless`
    calls that ran their full operation only because of it."""

    gates: int = 0


#: The open :func:`branch_free` trace (None: none).
_TRACE: BranchFreeTrace | None = None


@contextlib.contextmanager
def branch_free() -> Iterator[BranchFreeTrace]:
    """Every :func:`unless` runs its full operation, counted: for a step
    traced to be saved (``aot_cache``), whose export of ``torch.cond`` under
    a symbolic batch fails (a duplicate size argument, torch 2.13). A trace
    that met a gate is one whose saved program would do, every step, the
    work the gate skips: the caller refuses to save it."""
    global _TRACE
    before, _TRACE = _TRACE, BranchFreeTrace()
    try:
        yield _TRACE
    finally:
        _TRACE = before


def unless(
    needed: torch.Tensor,
    full: Callable[..., torch.Tensor],
    shortcut: Callable[..., torch.Tensor],
    operands: tuple[torch.Tensor, ...],
    tables: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """``full(*operands, *tables)`` where ``needed`` (a 0-d bool) holds or off
    the CPU, else ``shortcut`` of the same, which must equal ``full``'s on the
    live rows.

    The first operand is the ``[n, V]`` tensor worked on, aliasing no other;
    the rest are copied into a compiled branch (``torch.cond`` refuses
    operands that alias one another, as a step's views of one buffer do).
    ``tables``: large buffers the functions only read, each its own storage,
    passed as they are (a branch that closed over them failed to export).
    """
    first, *rest = operands
    if first.device.type != "cpu":
        return full(*operands, *tables)
    if _TRACE is not None:
        _TRACE.gates += 1
        return full(*operands, *tables)
    if torch.compiler.is_compiling():
        copied = (first, *(t.clone() for t in rest), *tables)
        return torch.cond(needed, full, shortcut, copied)
    return full(*operands, *tables) if bool(needed) else shortcut(*operands, *tables)
