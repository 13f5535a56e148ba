"""Declared outputs: where each output's batch axis is and how many rows per
request it holds, so replay slices the live rows by declaration, never by
guessing from a shape.

A decode step returns logits ``[bs, vocab]``: the default declaration (batch
axis 0, one row per request). A draft loop returns ``[steps, bs, topk]``
(``OutputSpec(batch_axis=1)``); a per-token output ``[bs * W, ...]``
(``OutputSpec(rows_per_request=W)``); a value with no batch axis is returned
whole (``OutputSpec(batch_axis=None)``). Shapes are checked against the
declarations at capture; a mismatch is an :class:`OutputDeclarationError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from graphrunner.declare.buffers import Axis, Size, units

__all__ = [
    "OutputDeclarationError",
    "OutputLayout",
    "OutputSpec",
    "Outputs",
    "OutputsDecl",
    "named_outputs",
    "poison_outputs",
]

#: What a forward returns: one tensor, a dict of tensors or a tuple of tensors.
Outputs: TypeAlias = torch.Tensor | dict[str, torch.Tensor] | tuple[torch.Tensor, ...]


class OutputDeclarationError(ValueError):
    """An output's shape or structure disagrees with its declaration."""


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output's layout.

    Args:
        batch_axis: the dim that holds ``bs * rows_per_request`` rows (negative
            counts from the end), or None for an output with no batch axis,
            returned whole.
        rows_per_request: rows per request along ``batch_axis`` (``W`` for a
            per-token output of ``W`` tokens per request, ``k`` for top-k).
        axis: what those rows count (a token batch): requests (the default,
            e.g. each request's last-token logits) or the step's tokens.
    """

    batch_axis: int | None = 0
    rows_per_request: int = 1
    axis: Axis = Axis.REQUEST

    def __post_init__(self) -> None:
        axis = self.batch_axis
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise ValueError(f"batch_axis={axis!r}; expected an int or None")
        rows = self.rows_per_request
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows_per_request={rows!r}; expected an int >= 1")

    def check(self, name: str, t: object, bs: Size, *, any_width: bool = False) -> None:
        """Raise :class:`OutputDeclarationError` unless ``t`` has ``bs`` requests' rows
        (``any_width``: any whole number of rows per request, for an eager batch
        of another width than the captured one)."""
        if not isinstance(t, torch.Tensor):
            raise OutputDeclarationError(
                f"output {name} is a {type(t).__name__}; expected a torch.Tensor"
            )
        if self.batch_axis is None:
            return
        if not -t.dim() <= self.batch_axis < t.dim():
            raise OutputDeclarationError(
                f"output {name} has shape {tuple(t.shape)}: batch_axis={self.batch_axis} "
                f"is out of range for {t.dim()} dims"
            )
        count = units(self.axis, bs)
        expected = count * self.rows_per_request
        rows = t.shape[self.batch_axis]
        other_width = any_width and self.rows_per_request > 1 and rows > 0 and rows % count == 0
        if rows != expected and not other_width:
            raise OutputDeclarationError(
                f"output {name} has shape {tuple(t.shape)}: expected {expected} rows "
                f"({count} {self.axis.value}s x rows_per_request={self.rows_per_request}) "
                f"on batch_axis={self.batch_axis}; declare its layout with OutputSpec"
            )

    def live(self, t: torch.Tensor, raw_bs: Size) -> torch.Tensor:
        """The live rows of ``t`` for a step of ``raw_bs`` live requests (a
        token batch: its :class:`~graphrunner.declare.buffers.StepSize`) (a view)."""
        if self.batch_axis is None:
            return t
        rows = units(self.axis, raw_bs) * self.rows_per_request
        if self.batch_axis == 0:
            return t[:rows]
        return t.narrow(self.batch_axis, 0, rows)


#: How a runner's outputs are declared: one spec for every output, or a spec
#: per dict key, or one per tuple element.
OutputsDecl: TypeAlias = OutputSpec | Mapping[str, OutputSpec] | Sequence[OutputSpec]

_DEFAULT = OutputSpec()


class OutputLayout:
    """The declared layout of a forward's outputs: checks them at capture,
    slices them at replay.

    ``OutputLayout(None)`` declares every output with the default
    :class:`OutputSpec` (batch axis 0, one row per request).
    """

    def __init__(self, decl: OutputsDecl | None = None) -> None:
        self._single: OutputSpec | None = None
        self._named: dict[str, OutputSpec] | None = None
        self._positional: tuple[OutputSpec, ...] | None = None
        self._last: tuple[Outputs, Size, Outputs] | None = None
        if decl is None or isinstance(decl, OutputSpec):
            self._single = decl or _DEFAULT
        elif isinstance(decl, Mapping):
            self._named = dict(decl)
            self._check_specs(self._named.values())
        elif isinstance(decl, Sequence) and not isinstance(decl, str):
            self._positional = tuple(decl)
            self._check_specs(self._positional)
        else:
            raise TypeError(
                f"outputs={decl!r}; expected an OutputSpec, a dict of them or a tuple of them"
            )

    @staticmethod
    def _check_specs(specs: Any) -> None:
        for spec in specs:
            if not isinstance(spec, OutputSpec):
                raise TypeError(f"outputs: expected OutputSpec, got {type(spec).__name__}")

    def check(self, out: object, bs: Size, *, any_width: bool = False) -> None:
        """Every output matches its declaration for ``bs`` requests."""
        for name, spec, t in self._pairs(out):
            spec.check(name, t, bs, any_width=any_width)

    def live(self, out: Outputs, raw_bs: Size) -> Outputs:
        """Views of ``out`` restricted to its first ``raw_bs`` requests. The
        last answer is kept: a graph's outputs are the same objects at every
        replay, so a repeated ``(out, raw_bs)`` costs an identity test (the
        previous views are returned, equal in every way to new ones; a dict
        of them is a new dict)."""
        last = self._last
        if last is not None and last[0] is out and last[1] == raw_bs:
            live = last[2]
        else:
            live = self._slice(out, raw_bs)
            self._last = (out, raw_bs, live)  # one entry: never holds more than one step
        # A dict is the caller's to change (pop a key): each gets its own.
        return dict(live) if isinstance(live, dict) else live

    def _slice(self, out: Outputs, raw_bs: Size) -> Outputs:
        if isinstance(out, torch.Tensor):
            return (self._single or _DEFAULT).live(out, raw_bs)
        if isinstance(out, dict):
            return {k: self._spec_for(k, i).live(v, raw_bs) for i, (k, v) in enumerate(out.items())}
        return tuple(self._spec_for(str(i), i).live(v, raw_bs) for i, v in enumerate(out))

    def _spec_for(self, key: str, index: int) -> OutputSpec:
        if self._single is not None:
            return self._single
        if self._named is not None:
            return self._named[key]
        assert self._positional is not None
        return self._positional[index]

    def _pairs(self, out: object) -> list[tuple[str, OutputSpec, object]]:
        if isinstance(out, torch.Tensor):
            if self._single is None:
                raise OutputDeclarationError(
                    "the forward returned one tensor; outputs were declared per "
                    f"{'key' if self._named is not None else 'element'}"
                )
            return [("(the tensor)", self._single, out)]
        if isinstance(out, dict):
            return self._dict_pairs(out)
        if isinstance(out, (tuple, list)):
            return self._tuple_pairs(out)
        raise OutputDeclarationError(
            f"the forward returned a {type(out).__name__}; expected a tensor, a dict of "
            f"tensors or a tuple of tensors"
        )

    def _dict_pairs(self, out: dict[Any, object]) -> list[tuple[str, OutputSpec, object]]:
        if self._positional is not None:
            raise OutputDeclarationError(
                "the forward returned a dict; outputs were declared as a tuple"
            )
        if self._named is not None and set(self._named) != set(out):
            raise OutputDeclarationError(
                f"the forward returned keys {sorted(map(str, out))}; outputs were declared "
                f"for {sorted(self._named)}"
            )
        return [(repr(k), self._spec_for(k, 0), v) for k, v in out.items()]

    def _tuple_pairs(self, out: Sequence[object]) -> list[tuple[str, OutputSpec, object]]:
        if self._named is not None:
            raise OutputDeclarationError(
                "the forward returned a tuple; outputs were declared by key"
            )
        if self._positional is not None and len(self._positional) != len(out):
            raise OutputDeclarationError(
                f"the forward returned {len(out)} outputs; {len(self._positional)} were declared"
            )
        return [(f"[{i}]", self._spec_for(str(i), i), v) for i, v in enumerate(out)]


def named_outputs(out: Outputs) -> list[tuple[str, torch.Tensor]]:
    """Each output tensor with the name messages give it: ``"output"`` for a
    lone tensor, its key in a dict, ``"output[i]"`` in a tuple."""
    if isinstance(out, torch.Tensor):
        return [("output", out)]
    if isinstance(out, dict):
        return list(out.items())
    return [(f"output[{i}]", t) for i, t in enumerate(out)]


def _leaves(out: Outputs) -> list[torch.Tensor]:
    return [t for _, t in named_outputs(out)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def poison_outputs(out: Outputs, spare: list[torch.Tensor]) -> None:
    """Overwrite a previous step's outputs (floats with NaN, integers with
    their dtype's minimum), except those sharing memory with a ``spare``
    tensor (the step's inputs and static buffers, still to be read).

    The output contract is the same on every mechanism: outputs are valid
    until the next replay. On CUDA the next replay overwrites them; a
    sanitized runner poisons them on every mechanism, so an engine that holds
    one too long fails on the CPU as it would on a GPU.
    """
    spared = {_storage(t) for t in spare}
    for t in _leaves(out):
        if _storage(t) in spared or t.dtype == torch.bool:
            continue
        value = float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min
        t.fill_(value)
