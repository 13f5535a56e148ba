"""Host-side helpers of the decode batch: host ints, mirror ranges, the
batch's geometry and its argument error (version counters and cached ranges:
:mod:`graphrunner.declare.sealed`)."""

from __future__ import annotations

import torch

from graphrunner.declare.decode import DECODE_HOST_MIRRORS, REQ_POOL_INDICES, SEQ_LENS
from graphrunner.declare.sealed import host_min_max
from graphrunner.pools.checks import as_index_list, check_count, check_device

__all__ = [
    "BatchError",
    "geometry",
    "host_ints",
    "host_min_max",
    "host_tensor",
    "mirror_ranges",
]


class BatchError(ValueError):
    """A wrong argument value (a wrong type is a ``TypeError``); the batch (and any
    pool) is left exactly as it was."""


def host_tensor(values: list[int]) -> torch.Tensor:
    """Host ints as a CPU int64 ``[n]`` tensor."""
    return torch.tensor(values, dtype=torch.int64)


def mirror_ranges(reqs: list[int], lens: list[int]) -> dict[str, tuple[int, int]]:
    """The mirrors' (min, max) from the host ints they were made from (none when empty)."""
    if not reqs:
        return {}
    return {
        DECODE_HOST_MIRRORS[REQ_POOL_INDICES]: (min(reqs), max(reqs)),
        DECODE_HOST_MIRRORS[SEQ_LENS]: (min(lens), max(lens)),
    }


def host_ints(name: str, values: object, what: str = "ints") -> list[int]:
    """Python or NumPy ints from a sequence or a 1-D integer CPU tensor, as the pools take."""
    expected = f"a sequence of {what} (host ints or a 1-D integer CPU tensor)"
    return as_index_list(values, name, expected=expected, error=BatchError)


def geometry(where: str, device: object, max_context_len: object) -> tuple[torch.device, int]:
    """A batch's ``device`` (indexed) and ``max_context_len`` (>= 1), checked by name."""
    return (
        _indexed(check_device(f"{where}: device", device, BatchError)),
        check_count(f"{where}: max_context_len", max_context_len, 1, error=BatchError),
    )


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the CUDA device it means now (``cuda:0``), as a tensor made
    there reports it: a runner compares a sealed batch's device exactly."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
