"""Capture mechanisms: how a size is captured and launched (CUDA graphs, with
or without an inductor-compiled forward; inductor programs called directly;
eager). A runner composes one; see :class:`CaptureMechanism`."""

from __future__ import annotations

import inspect
from typing import Any

from graphrunner.mechanisms.base import CaptureMechanism, ForwardFn, Launcher
from graphrunner.mechanisms.compile import UncapturableError
from graphrunner.mechanisms.cuda_graph import CudaGraphCapture
from graphrunner.mechanisms.eager import EagerCapture
from graphrunner.mechanisms.inductor import InductorCapture

__all__ = [
    "MECHANISMS",
    "CaptureMechanism",
    "CudaGraphCapture",
    "EagerCapture",
    "ForwardFn",
    "InductorCapture",
    "Launcher",
    "UncapturableError",
    "check_mechanism_options",
    "create_mechanism",
]

MECHANISMS: dict[str, type[CaptureMechanism]] = {
    cls.kind: cls for cls in (CudaGraphCapture, InductorCapture, EagerCapture)
}


def create_mechanism(kind: str, **options: Any) -> CaptureMechanism:
    """The mechanism named ``kind`` (``cuda``, ``cpu`` or ``eager``) with its options
    (``compile``, ``compile_mode``, ``inductor_options``, ``dynamic_batch``,
    ``fullgraph`` where it takes them)."""
    check_mechanism_options(kind, options)
    return MECHANISMS[kind](**options)


#: Every option some mechanism takes.
MECHANISM_OPTIONS = frozenset(
    {"compile", "compile_mode", "inductor_options", "populate", "dynamic_batch", "fullgraph"}
)


def check_mechanism_options(kind: str, options: dict[str, Any]) -> None:
    """Refuse an unknown ``kind``, or a mechanism option that ``kind`` does not
    take (``compile=True`` on the eager runner), naming the option."""
    if not isinstance(kind, str) or kind not in MECHANISMS:
        raise ValueError(f"unknown runner kind {kind!r}; expected one of {sorted(MECHANISMS)}")
    takes = set(inspect.signature(MECHANISMS[kind]).parameters)
    for name in sorted(set(options) & MECHANISM_OPTIONS - takes):
        raise TypeError(
            f"runner kind {kind!r} takes no option {name}={options[name]!r} "
            f"(its options: {sorted(takes) or 'none'})"
        )
