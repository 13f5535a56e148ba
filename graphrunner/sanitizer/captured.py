"""Captured-state identity: the tensors a captured forward reads are the ones
it read at capture.

A CUDA graph replays the addresses it captured and an inductor program the
tensors it was compiled with: a parameter, buffer or tensor attribute of the
model *reassigned* after capture (``model.scale = torch.tensor(3.0)``) is
silently ignored by the replay while the eager forward reads the new one.
The rule: update captured state in place (``model.scale.copy_(...)``), or
capture again. :class:`CapturedState` records, at capture, every tensor
reachable from the forward's modules (the bound method's module, modules in
its closure or a ``functools.partial``'s arguments) by attribute path, and
:meth:`CapturedState.check` (run by the sanitizer on every replay) raises
:class:`~graphrunner.sanitizer.padding.PaddingViolation` naming the first
path whose tensor is another object or lives at another address.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from graphrunner.sanitizer.checks import PaddingViolation

__all__ = ["CapturedState"]

#: How deep closures and partials are searched for modules.
_DEPTH = 3


def _modules_of(forward: object, depth: int = _DEPTH) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` pairs the forward can reach."""
    if depth < 0:
        return
    if isinstance(forward, nn.Module):
        yield type(forward).__name__.lower(), forward
        return
    owner = getattr(forward, "__self__", None)
    if isinstance(owner, nn.Module):
        yield "model", owner
        return
    if isinstance(forward, functools.partial):
        for i, arg in enumerate((forward.func, *forward.args, *forward.keywords.values())):
            for name, module in _modules_of(arg, depth - 1):
                yield f"{name}{i}" if i else name, module
        return
    closure = getattr(forward, "__closure__", None) or ()
    names = getattr(getattr(forward, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, closure, strict=False):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module):
            yield name, value
        elif callable(value):
            yield from _modules_of(value, depth - 1)


def _tensors(prefix: str, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and plain tensor attribute of ``module`` and
    its submodules, by attribute path."""
    for path, sub in module.named_modules(prefix=prefix):
        for name, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                yield f"{path}.{name}", value
        for name, param in sub.named_parameters(recurse=False):
            yield f"{path}.{name}", param
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None:
                yield f"{path}.{name}", buf


def _lookup(root: nn.Module, path: list[str]) -> object:
    value: object = root
    for part in path:
        value = getattr(value, part, None)
    return value


class CapturedState:
    """The tensors ``forward``'s modules held at capture, by attribute path.

    Args:
        forward: the captured step (a bound method of a module, or a function
            whose closure or partial arguments hold modules).
    """

    def __init__(self, forward: Callable[..., Any]) -> None:
        self._roots: dict[str, nn.Module] = {}
        self._seen: dict[str, tuple[torch.Tensor, int]] = {}
        for root, module in _modules_of(forward):
            self._roots[root] = module
            for path, tensor in _tensors(root, module):
                self._seen.setdefault(path, (tensor, tensor.data_ptr()))

    def __len__(self) -> int:
        return len(self._seen)

    def check(self) -> None:
        """Raise :class:`PaddingViolation` naming the first tensor replaced or
        moved since capture."""
        for path, (tensor, address) in self._seen.items():
            root, *rest = path.split(".")
            now = _lookup(self._roots[root], rest)
            if now is tensor and tensor.data_ptr() == address:
                continue
            what = "reassigned" if now is not tensor else "moved to new storage (.data or resize)"
            raise PaddingViolation(
                f"captured state {path} was {what} after capture: the replay reads the "
                "tensor it captured, the eager forward the new one; update it in place "
                "(copy_) or capture again"
            )
