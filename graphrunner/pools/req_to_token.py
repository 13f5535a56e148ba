"""Request pools: one ``req_to_token`` row per live request, row 0 reserved for padding."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner.pools.errors import InvalidSlot, PoolError
from graphrunner.pools.slots import DeviceLike, SlotAllocator, SlotPool, check_count

__all__ = ["DecodeReqToTokenPool", "ReqToTokenPool"]


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
        self.size = check_count("size", size, minimum=1)
        self.max_context_len = check_count("max_context_len", max_context_len, minimum=1)
        self.device = torch.device(device)
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
        self._check_row(req_index)
        n = self._check_locs(locs)
        start = check_count("start", start)
        if start + n > self.max_context_len:
            raise PoolError(
                f"write of {n} tokens at start {start} to request {req_index} ends at "
                f"{start + n}, past max_context_len {self.max_context_len}"
            )
        if n == 0:
            return
        self.req_to_token[req_index, start : start + n].copy_(
            self._locs_tensor(locs), non_blocking=True
        )

    def write_tokens(
        self,
        req_indices: Sequence[int],
        positions: Sequence[int],
        locs: torch.Tensor | Sequence[int],
    ) -> None:
        """One token per entry: ``req_to_token[req_indices[i], positions[i]] = locs[i]``.

        One vectorised device write (index_put_) of index tensors built on the host.
        ``locs``: 1-D integer tensor ``[len(req_indices)]`` on the CPU or ``device``,
        or host ints.
        """
        n_locs = self._check_locs(locs)
        if not len(req_indices) == len(positions) == n_locs:
            raise PoolError(
                f"write_tokens got {len(req_indices)} rows, {len(positions)} positions and "
                f"{n_locs} locs; expected equal lengths"
            )
        for row, pos in zip(req_indices, positions, strict=True):
            self._check_row(row)
            pos = check_count(f"position of request {row}", pos)
            if pos >= self.max_context_len:
                raise PoolError(
                    f"position {pos} of request {row} is outside 0..{self.max_context_len - 1}"
                )
        if not req_indices:
            return
        rows = torch.tensor(list(req_indices), dtype=torch.int64).to(self.device, non_blocking=True)
        cols = torch.tensor(list(positions), dtype=torch.int64).to(self.device, non_blocking=True)
        vals = self._locs_tensor(locs).to(self.device, non_blocking=True)
        self.req_to_token.index_put_((rows, cols), vals)

    @staticmethod
    def _locs_tensor(locs: torch.Tensor | Sequence[int]) -> torch.Tensor:
        if isinstance(locs, torch.Tensor):
            return locs.to(torch.int32)
        return torch.tensor(list(locs), dtype=torch.int32)

    def _check_row(self, req_index: int) -> None:
        if isinstance(req_index, bool) or not isinstance(req_index, int):
            raise InvalidSlot(f"request index must be an int, got {req_index!r}")
        self._slots.check_in_range(req_index)
        if not self._slots.is_allocated(req_index):
            raise InvalidSlot(f"request slot {req_index} is not allocated; write to a live row")

    def _check_locs(self, locs: torch.Tensor | Sequence[int]) -> int:
        if not isinstance(locs, torch.Tensor):
            if any(isinstance(x, bool) or not isinstance(x, int) for x in locs):
                raise PoolError(f"locs must be ints, got {list(locs)!r}")
            bad = [x for x in locs if not 0 <= x < 2**31]
            if bad:  # req_to_token is int32: a larger value would wrap silently
                raise PoolError(f"locs {bad} are outside 0..2**31-1 (req_to_token is int32)")
            return len(locs)
        if locs.dim() != 1:
            raise PoolError(f"locs has shape {tuple(locs.shape)}; expected 1-D")
        if locs.dtype == torch.bool or locs.is_floating_point() or locs.is_complex():
            raise PoolError(f"locs has dtype {locs.dtype}; expected an integer dtype")
        if locs.device.type not in ("cpu", self.device.type):
            raise PoolError(f"locs is on {locs.device}; expected the CPU or {self.device}")
        return int(locs.shape[0])


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
        self.pre_alloc_size = check_count("pre_alloc_size", pre_alloc_size)
        super().__init__(size, max_context_len, device)

    @property
    def num_slots(self) -> int:
        return self.size + self.pre_alloc_size
