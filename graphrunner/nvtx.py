"""Named NVTX ranges in a ``graphrunner`` domain, for Nsight Systems.

Uses the ``nvtx`` package (works without a GPU, about a microsecond a range)
rather than ``torch.cuda.nvtx``, which raises on CPU builds of torch. Each
range is also a ``torch.profiler.record_function`` when a torch profiler is
running, so the same names appear in a torch trace. ``GRAPHRUNNER_NVTX`` set
to ``0``, ``false``, ``off``, ``no`` or empty (read at import) turns ranges
into a shared no-op context.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import nvtx as _nvtx
import torch

__all__ = ["DOMAIN", "enabled", "range", "set_enabled"]

DOMAIN = "graphrunner"
_domain = _nvtx.get_domain(DOMAIN)
_OFF = frozenset({"0", "false", "off", "no", ""})
_enabled = os.environ.get("GRAPHRUNNER_NVTX", "1").strip().lower() not in _OFF


def set_enabled(on: bool) -> None:
    """Turn graphrunner's ranges on or off process-wide."""
    global _enabled
    if not isinstance(on, bool):
        raise TypeError(f"set_enabled takes a bool, got {on!r}")
    _enabled = on


def enabled() -> bool:
    return _enabled


def _profiler_active() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


@contextlib.contextmanager
def _named_range(name: str) -> Iterator[None]:
    attrs = _domain.get_event_attributes(message=name)
    _domain.push_range(attrs)
    try:
        if _profiler_active():
            with torch.profiler.record_function(f"{DOMAIN}::{name}"):
                yield
        else:
            yield
    finally:
        _domain.pop_range()


_NULL = contextlib.nullcontext()


def range(name: str) -> contextlib.AbstractContextManager[None]:  # noqa: A001
    """A context manager marking ``name`` in Nsight (and in torch profiler traces)."""
    if not _enabled:
        return _NULL
    return _named_range(name)
