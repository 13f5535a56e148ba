"""Every option of a runner, in one dataclass: where it runs, which sizes it
captures, what checks it, and how it captures (the mechanism's options, the
one place they are spelled next to the mechanisms' own constructors)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphrunner.core.future_map import FutureMap
from graphrunner.declare.state_ops import StateOps
from graphrunner.mechanisms import MECHANISMS, CaptureMechanism
from graphrunner.sanitizer.padding import PaddingSanitizer

__all__ = ["MECHANISM_FIELDS", "RunnerOptions", "best_runner_kind"]


def best_runner_kind() -> str:
    """``"cuda"`` where a CUDA device is available, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    """How a runner is built, apart from what it captures (the :class:`Phase`).

    Args:
        kind: the mechanism: ``"cuda"`` (CUDA graphs), ``"cpu"`` (one inductor
            program called directly at each size) or ``"eager"`` (the forward
            on the padded buffers, the reference); default: ``"cuda"`` on a
            CUDA ``device``, ``"cpu"`` on another one, else
            :func:`best_runner_kind`.
        device: where the buffers live; default ``"cuda"`` for ``kind="cuda"``,
            else ``"cpu"``.
        capture_sizes, max_bs: the batch sizes captured (default: powers of
            two and multiples of 8 up to ``max_bs``).
        sanitizer: a :class:`~graphrunner.PaddingSanitizer` checking every
            replay (a debug mode), or None.
        future_map: where buffers declared ``future=True`` resolve their
            references from (overlap scheduling).
        state_ops: a pool whose recorded state ops run before every launch.
        show_progress: a progress bar while capturing.
        compile: ``cuda`` only: capture an inductor-compiled forward.
        compile_mode, inductor_options: inductor settings (``cpu``; ``cuda``
            with ``compile``).
        populate: ``cuda`` only: ``"torch"``, ``"fused"`` or ``"graph"``.
        dynamic_batch: one compiled program for every size (True) or one per size.
        fullgraph: refuse a forward with a graph break, by name.
        aot_cache, aot_key: ``cpu`` only: the program saved in a folder and
            loaded without tracing (:mod:`graphrunner.mechanisms.aot`).

    A mechanism option the chosen kind does not take, given otherwise than
    its default, is a TypeError naming it.
    """

    kind: str | None = None
    device: torch.device | str | None = None
    capture_sizes: Sequence[int] | None = None
    max_bs: int | None = None
    sanitizer: PaddingSanitizer | None = None
    future_map: FutureMap | None = None
    state_ops: StateOps | None = None
    show_progress: bool = True
    compile: bool = False
    compile_mode: str | None = None
    inductor_options: Mapping[str, Any] | None = None
    populate: str = "torch"
    dynamic_batch: bool = True
    fullgraph: bool = False
    aot_cache: str | os.PathLike[str] | None = None
    aot_key: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.kind is not None and self.kind not in MECHANISMS:
            raise ValueError(f"kind={self.kind!r}; expected one of {sorted(MECHANISMS)}")
        kind = self.resolved_kind
        takes = _takes(MECHANISMS[kind])
        for name in MECHANISM_FIELDS:
            if name not in takes and getattr(self, name) != _DEFAULTS[name]:
                raise TypeError(
                    f"runner kind {kind!r} takes no option {name}={getattr(self, name)!r} "
                    f"(its options: {sorted(takes) or 'none'})"
                )

    @classmethod
    def of(cls, options: RunnerOptions | None, fields: Mapping[str, Any]) -> RunnerOptions:
        """``options`` (default: all defaults) with ``fields`` replaced; an
        unknown field is a TypeError naming it and every known one."""
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            known = sorted(_FIELDS)
            raise TypeError(f"unknown runner option(s) {unknown}; expected some of {known}")
        return dataclasses.replace(options or cls(), **fields)

    @property
    def resolved_kind(self) -> str:
        """The mechanism's kind, the default resolved from the device."""
        if self.kind is not None:
            return self.kind
        if self.device is not None:
            return "cuda" if torch.device(self.device).type == "cuda" else "cpu"
        return best_runner_kind()

    @property
    def resolved_device(self) -> torch.device:
        """Where the buffers live, the default resolved from the kind."""
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if self.resolved_kind == "cuda" else "cpu")

    def mechanism(self) -> CaptureMechanism:
        """A new mechanism of :attr:`resolved_kind` with the options it takes."""
        kind = self.resolved_kind
        mechanism = MECHANISMS[kind]
        return mechanism(**{n: getattr(self, n) for n in _takes(mechanism)})


@functools.cache
def _takes(mechanism: type[CaptureMechanism]) -> frozenset[str]:
    """The options ``mechanism``'s constructor takes (read once per class)."""
    return frozenset(inspect.signature(mechanism).parameters)


#: The options that belong to a mechanism: those some built-in kind takes.
MECHANISM_FIELDS = tuple(sorted(frozenset().union(*map(_takes, MECHANISMS.values()))))
_FIELDS = frozenset(f.name for f in dataclasses.fields(RunnerOptions))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunnerOptions)}
