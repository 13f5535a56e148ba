"""Named NVTX ranges in a ``graphrunner`` domain, for Nsight Systems.

Uses the ``nvtx`` package (works without a GPU, about a microsecond a range)
rather than ``torch.cuda.nvtx``, which raises on CPU builds of torch. Each
range is also a ``torch.profiler.record_function`` when a torch profiler is
running, so the same names appear in a torch trace. ``GRAPHRUNNER_NVTX`` set
to ``0``, ``false``, ``off``, ``no`` or empty (read at import) turns ranges
into a shared no-op context.

Free when nobody profiles: a range is pushed only while an NVTX tool is
injected (Nsight Systems / Compute set ``NVTX_INJECTION64_PATH`` in the
profiled process, read at import) or a torch profiler runs; otherwise
:func:`range` returns the shared no-op. Range attributes are built once per
name, and the range itself is a small class, not a generator.
"""

from __future__ import annotations

import contextlib
import os

import nvtx as _nvtx
import torch

__all__ = ["DOMAIN", "SWITCH", "active", "enabled", "range", "set_enabled"]

DOMAIN = "graphrunner"
_domain = _nvtx.get_domain(DOMAIN)
_OFF = frozenset({"0", "false", "off", "no", ""})


class _Switch:
    """Whether ranges are on (``enabled``) and an NVTX tool is injected
    (``injected``, read at import): plain attributes, so that a replay reads
    them without a call."""

    __slots__ = ("enabled", "injected")

    def __init__(self) -> None:
        self.enabled = os.environ.get("GRAPHRUNNER_NVTX", "1").strip().lower() not in _OFF
        self.injected = any(
            os.environ.get(v) for v in ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
        )


#: The process-wide switch (:func:`set_enabled` sets it).
SWITCH = _Switch()


def set_enabled(on: bool) -> None:
    """Turn graphrunner's ranges on or off process-wide."""
    if not isinstance(on, bool):
        raise TypeError(f"set_enabled takes a bool, got {on!r}")
    SWITCH.enabled = on


def enabled() -> bool:
    return SWITCH.enabled


def _profiler_active() -> bool:
    return bool(torch.autograd.profiler._is_profiler_enabled)


_attributes: dict[tuple[object, str], object] = {}


class _Range:
    """One pushed range (and a torch ``record_function`` while a profiler runs)."""

    __slots__ = ("_name", "_record")

    def __init__(self, name: str) -> None:
        self._name = name
        self._record: torch.profiler.record_function | None = None

    def __enter__(self) -> None:
        key = (_domain, self._name)
        attrs = _attributes.get(key)
        if attrs is None:
            attrs = _attributes[key] = _domain.get_event_attributes(message=self._name)
        _domain.push_range(attrs)
        if _profiler_active():
            self._record = torch.profiler.record_function(f"{DOMAIN}::{self._name}")
            self._record.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            if self._record is not None:
                self._record.__exit__(*exc)
        finally:
            _domain.pop_range()


_NULL = contextlib.nullcontext()


def active() -> bool:
    """Whether :func:`range` pushes ranges now (enabled, and an NVTX tool
    injected or a torch profiler running)."""
    return SWITCH.enabled and (SWITCH.injected or torch.autograd.profiler._is_profiler_enabled)


def range(name: str) -> contextlib.AbstractContextManager[None]:  # noqa: A001
    """A context manager marking ``name`` in Nsight (and in torch profiler
    traces); the shared no-op when disabled or when nothing is profiling."""
    if not active():
        return _NULL
    return _Range(name)
