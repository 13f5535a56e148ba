"""Which sizes one program with a symbolic batch dimension may serve.

Dynamo records two kinds of shape guards on such a program: those its trace
made (the forward's own decisions on sizes: a Python branch on the batch, an
equality between two buffers' rows) and those inductor's lowering added while
generating code (``s > 1`` where it computed the strides of a view: a stride
of a size-1 dimension never moves an address, so batch 1 computes the same).
Dynamo would recompile on either; the compiler drops dynamo's shape guards and
checks the trace's ones here, at each size's arguments: a size they fail gets
a program of its own, never the wrong branch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch

__all__ = ["MAX_ENUMERATED", "TraceGuards", "without_shape_guards"]

#: The most batch sizes :meth:`TraceGuards.hold_up_to` checks one by one.
MAX_ENUMERATED = 1 << 14


def without_shape_guards(guards: Sequence[Any]) -> list[bool]:
    """Dynamo's guard filter: keep every guard but the symbolic-shape ones
    (:class:`TraceGuards` checks the trace's at capture)."""
    return [g.guard_type != "SHAPE_ENV" for g in guards]


def _symbol(value: object) -> sympy.Symbol | None:
    if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
        return value.node.expr
    return None


@dataclass(frozen=True)
class TraceGuards:
    """The shape guards a trace made, and where each placeholder's symbols sit.

    ``examples``: each graph input's example value (a fake tensor with
    symbolic sizes, a SymInt, or a constant), in the order the program takes
    its arguments.
    """

    guards: tuple[sympy.Expr, ...]
    examples: tuple[object, ...]

    @classmethod
    def of_trace(cls, gm: torch.fx.GraphModule) -> TraceGuards:
        """The guards the current trace made so far (call it before inductor lowers)."""
        context = torch._guards.TracingContext.try_get()
        fake_mode = None if context is None else context.fake_mode
        shape_env = None if fake_mode is None else fake_mode.shape_env
        guards: tuple[sympy.Expr, ...] = ()
        if shape_env is not None:
            # In the symbols the program takes (the trace unified equal sizes).
            replaced = (shape_env.replace(g.expr) for g in shape_env.guards)
            guards = tuple(g for g in replaced if g is not sympy.true)
        examples = tuple(n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder"))
        return cls(guards, examples)

    def _values(self, args: Sequence[object]) -> dict[sympy.Symbol, int]:
        values: dict[sympy.Symbol, int] = {}
        for example, arg in zip(self.examples, args, strict=False):
            if (sym := _symbol(example)) is not None and isinstance(arg, int):
                values[sym] = arg
            elif isinstance(example, torch.Tensor) and isinstance(arg, torch.Tensor):
                for size, n in zip(example.shape, arg.shape, strict=False):
                    if (sym := _symbol(size)) is not None:
                        values[sym] = n
        return values

    def hold(self, args: Sequence[object]) -> bool:
        """Whether every guard holds for the sizes of ``args`` (False where a
        guard names a symbol the arguments do not give)."""
        if not self.guards:
            return True
        values = self._values(args)
        for guard in self.guards:
            if not guard.free_symbols <= values.keys():
                return False
            if not bool(guard.xreplace({s: sympy.Integer(v) for s, v in values.items()})):
                return False
        return True

    def hold_up_to(self, args: Sequence[object], most: int = MAX_ENUMERATED) -> bool:
        """Whether every guard holds for every batch from 1 to the one of
        ``args``: a program traced at a runner's largest size then serves all
        of its sizes, whatever the forward decided on its batch. Checked size
        by size for a trace whose guards name one symbol, up to ``most``
        sizes (False past that, or for guards over several symbols)."""
        if not self.guards:
            return True
        values = self._values(args)
        symbols = set().union(*(g.free_symbols for g in self.guards))
        if len(symbols) != 1 or not symbols <= values.keys():
            return False
        (symbol,) = symbols
        if values[symbol] > most:
            return False
        return all(
            bool(g.xreplace({symbol: sympy.Integer(n)}))
            for n in range(1, values[symbol] + 1)
            for g in self.guards
        )
