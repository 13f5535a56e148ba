"""Request pools: one ``req_to_token`` row per live request, row 0 reserved for padding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner.pools.checks import (
    DeviceLike,
    as_index_list,
    bad_arg,
    check_count,
    check_device,
    check_each,
    check_tensor,
)
from graphrunner.pools.errors import InvalidSlot, PoolError
from graphrunner.pools.slots import SlotAllocator, SlotPool

__all__ = ["DecodeReqToTokenPool", "ReqToTokenPool"]

#: req_to_token is int32: a larger KV slot would wrap silently.
_MAX_LOC = 2**31 - 1


class ReqToTokenPool(SlotPool):
    """Maps each request (a pool row) to the KV slots of its tokens.

    Tensors:
        req_to_token: int32 ``[num_slots + 1, max_context_len]`` on ``device``,
            zero-initialised. ``req_to_token[r, p]`` is the KV slot of token ``p``
            of the request at row ``r``. Row 0 is the padding row: never handed
            out, never written, all zeros, so a padded row that reads it lands
            on the reserved KV slot 0.

    Rows are handed out lowest first by ``alloc``; every failing call leaves the
    pool unchanged, and no method reads a device value back to the host.
    """

    def __init__(self, size: int, max_context_len: int, device: DeviceLike) -> None:
        where = type(self).__name__
        self.size = check_count(f"{where}: size", size, minimum=1)
        self.max_context_len = check_count(f"{where}: max_context_len", max_context_len, minimum=1)
        self.device = check_device(f"{where}: device", device)
        self._slots = SlotAllocator(self.num_slots, name="request slot")
        self.req_to_token = torch.zeros(
            (self.num_slots + 1, self.max_context_len), dtype=torch.int32, device=self.device
        )

    @property
    def num_slots(self) -> int:
        """Rows that can be handed out (``1..num_slots``)."""
        return self.size

    # NOTE: free() leaves a row's stale token slots in place: a row is only read
    # at positions its next owner has written, and padded rows read row 0.

    def clear(self) -> None:
        """Back to the initial state: every row free, ``req_to_token`` all zeros."""
        self._slots.clear()
        self.req_to_token.zero_()

    def write(self, req_index: int, start: int, locs: torch.Tensor | Sequence[int]) -> None:
        """``req_to_token[req_index, start:start + len(locs)] = locs``.

        ``locs``: host ints, or a 1-D integer tensor on the CPU or on ``device``
        (any integer dtype; cast to int32). Its values are not inspected, so a
        device tensor is never read back.
        """
        row = self._check_row(req_index, "write: req_index")
        values = self._check_locs(locs, "write: locs")
        n = len(values)
        end = f"start + {n} locs <= max_context_len {self.max_context_len}"
        start = check_count("write: start", start, 0, self.max_context_len - n, what=end)
        if n == 0:
            return
        self.req_to_token[row, start : start + n].copy_(_as_int32(values), non_blocking=True)

    def write_tokens(
        self,
        req_indices: Sequence[int],
        positions: Sequence[int],
        locs: torch.Tensor | Sequence[int],
    ) -> None:
        """One token per entry: ``req_to_token[req_indices[i], positions[i]] = locs[i]``.

        One vectorised device write (index_put_) of index tensors built on the host.
        ``req_indices``, ``positions``: host ints (or 1-D integer CPU tensors).
        ``locs``: 1-D integer tensor ``[len(req_indices)]`` on the CPU or ``device``,
        or host ints.
        """
        rows = as_index_list(req_indices, "write_tokens: req_indices", error=PoolError)
        cols = as_index_list(positions, "write_tokens: positions", error=PoolError)
        values = self._check_locs(locs, "write_tokens: locs")
        if not len(rows) == len(cols) == len(values):
            raise PoolError(
                f"write_tokens: {len(rows)} req_indices, {len(cols)} positions and "
                f"{len(values)} locs; expected equal lengths"
            )
        self._slots.check_allocated(
            rows, "write_tokens: req_indices", unique=False, free_error=InvalidSlot
        )
        check_each("write_tokens: positions", cols, 0, self.max_context_len - 1)
        if not rows:
            return
        index = (self._on_device(rows), self._on_device(cols))
        self.req_to_token.index_put_(index, _as_int32(values).to(self.device, non_blocking=True))

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _check_row(self, req_index: object, name: str) -> int:
        row = self._slots.check_in_range(req_index, name)
        if not self._slots.is_allocated(row):
            expected = "an allocated request slot (write to a live row)"
            raise bad_arg(name, req_index, expected, InvalidSlot)
        return row

    def _check_locs(self, locs: object, name: str) -> torch.Tensor | list[int]:
        """``locs`` as a 1-D integer tensor on the CPU or ``device`` (values not read)
        or as host ints in ``0..2**31-1``."""
        if isinstance(locs, torch.Tensor):
            devices = ("cpu", self.device)
            return check_tensor(name, locs, dtype="integer", shape=(None,), devices=devices)
        values = as_index_list(locs, name, error=PoolError)
        check_each(name, values, 0, _MAX_LOC, what="a KV slot in 0..2**31-1 (int32)")
        return values


def _as_int32(locs: torch.Tensor | list[int]) -> torch.Tensor:
    if isinstance(locs, torch.Tensor):
        return locs.to(torch.int32)
    return torch.tensor(locs, dtype=torch.int32)


class DecodeReqToTokenPool(ReqToTokenPool):
    """A request pool with ``pre_alloc_size`` extra rows for requests whose KV is
    pre-allocated before they reach decode (disaggregated decode).

    ``req_to_token`` is ``[size + pre_alloc_size + 1, max_context_len]``; rows
    ``1..size + pre_alloc_size`` are handed out, row 0 is padding as in the base.
    """

    def __init__(
        self, size: int, max_context_len: int, device: DeviceLike, pre_alloc_size: int
    ) -> None:
        # Set before the base constructor, which sizes everything from num_slots.
        self.pre_alloc_size = check_count("DecodeReqToTokenPool: pre_alloc_size", pre_alloc_size)
        super().__init__(size, max_context_len, device)

    @property
    def num_slots(self) -> int:
        return self.size + self.pre_alloc_size
