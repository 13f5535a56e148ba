"""Capture-size policy: which batch sizes get a graph, and padding to them.

Pure functions on host integers, testable without a device.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "BatchSizeError",
    "PaddingWaste",
    "default_capture_sizes",
    "default_token_sizes",
    "pad_to",
    "padding_waste",
    "validate_capture_sizes",
]


class BatchSizeError(ValueError):
    """A batch size no captured graph can serve (below 1 or above the largest)."""


def default_capture_sizes(max_bs: int) -> list[int]:
    """Dense at small sizes where most decode batches live, coarser above.

    ``1, 2, 4, 8, 12, 16, 24, 32, 40, ... 256`` (step 8), then step 16 up to
    512 and step 32 beyond; capped at ``max_bs``, which is always included.
    """
    if isinstance(max_bs, bool) or not isinstance(max_bs, int) or max_bs < 1:
        raise ValueError(f"max_bs must be a positive int, got {max_bs!r}")
    sizes = [1, 2, 4, 8, 12]
    sizes += list(range(16, 257, 8)) + list(range(272, 513, 16))
    bs = 544
    while bs <= max_bs:
        sizes.append(bs)
        bs += 32
    capped = [s for s in sizes if s < max_bs]
    return [*capped, max_bs]


def default_token_sizes(max_tokens: int) -> list[int]:
    """A token batch's sizes (tokens per step): powers of two from 4, capped
    at ``max_tokens``, which is always included. Few sizes, since each
    costs a run of the step at capture (a compiled CPU program one, a CUDA
    graph three), and a chunked prefill's steps fill the budget: the largest
    size is what most of them replay."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    sizes = [4]
    while sizes[-1] * 2 < max_tokens:
        sizes.append(sizes[-1] * 2)
    return [*(s for s in sizes if s < max_tokens), max_tokens]


def validate_capture_sizes(sizes: Iterable[int]) -> list[int]:
    """Return ``sizes`` as a list of Python ints if positive and strictly
    increasing (any iterable of ints, NumPy ints included); else raise."""
    if isinstance(sizes, (set, frozenset)):
        raise ValueError(f"capture_sizes must be ordered (a list), got a set {sorted(sizes)}")
    sizes = [_size(i, s) for i, s in enumerate(sizes)]
    if len(sizes) == 0:
        raise ValueError("capture_sizes must not be empty")
    for i, s in enumerate(sizes):
        if s < 1:
            raise ValueError(f"capture_sizes[{i}] must be positive, got {s}")
        if i and s <= sizes[i - 1]:
            raise ValueError(
                f"capture_sizes must be sorted and unique: capture_sizes[{i}]={s} "
                f"follows {sizes[i - 1]}"
            )
    return list(sizes)


def _size(i: int, s: object) -> int:
    if isinstance(s, bool) or not hasattr(s, "__index__"):
        raise ValueError(f"capture_sizes[{i}] must be an int, got {s!r}")
    return operator.index(s)


def pad_to(sizes: Sequence[int], raw_bs: int) -> int:
    """The smallest captured size ``>= raw_bs``.

    ``sizes`` must be sorted ascending, as :func:`validate_capture_sizes`
    returns them; this is called per replay, so it does not re-check them.
    """
    if isinstance(raw_bs, bool) or not isinstance(raw_bs, int):
        raise BatchSizeError(f"batch size must be an int, got {raw_bs!r}")
    if not sizes:
        raise BatchSizeError("no captured sizes to pad to")
    if raw_bs < 1:
        raise BatchSizeError(f"batch size must be >= 1, got {raw_bs}")
    i = bisect.bisect_left(sizes, raw_bs)
    if i == len(sizes):
        raise BatchSizeError(f"batch size {raw_bs} exceeds the largest captured size {sizes[-1]}")
    return sizes[i]


@dataclass(frozen=True, slots=True)
class PaddingWaste:
    """Padded rows over a workload: ``padded / (live + padded)``."""

    live_rows: int
    padded_rows: int

    @property
    def fraction(self) -> float:
        total = self.live_rows + self.padded_rows
        return self.padded_rows / total if total else 0.0


def padding_waste(sizes: Sequence[int], batch_sizes: Iterable[int]) -> PaddingWaste:
    """Rows wasted on padding if each of ``batch_sizes`` replays a graph of
    ``sizes`` (validated); a batch above the largest size runs eagerly, unpadded,
    as the runner does."""
    sizes = validate_capture_sizes(sizes)
    live = padded = 0
    for raw_bs in batch_sizes:
        live += raw_bs
        if raw_bs <= sizes[-1]:
            padded += pad_to(sizes, raw_bs) - raw_bs
    return PaddingWaste(live, padded)
