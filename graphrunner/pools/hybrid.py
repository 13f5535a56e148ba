"""Request pools of hybrid models: each request row also owns a Mamba state slot.

The per-request mappings (request row -> Mamba slot, and request row -> its
two ping-pong track slots when enabled) are sized by the request pool,
``num_slots + 1`` rows, never by the Mamba pool; row 0 maps to Mamba slot 0,
the padding sink, so a padded row that reads the mapping lands on the sink.

The pool never touches state tensors. Allocating a request records a clear of
its new slot, forking records a copy of the parent's state (copy-on-write: a
forked request owns its own slot from the start), and a track snapshot
records a copy into a track slot; the runner's pre-launch step runs them on
the forward's stream (:mod:`graphrunner.declare.state_ops`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner.pools.checks import DeviceLike, as_index_list, bad_arg, check_count
from graphrunner.pools.errors import InvalidSlot, PoolError, PoolExhausted
from graphrunner.pools.mamba import MambaStatePool, PendingStateOp
from graphrunner.pools.req_to_token import ReqToTokenPool

__all__ = ["DecodeHybridReqToTokenPool", "HybridReqToTokenPool"]


class HybridReqToTokenPool(ReqToTokenPool):
    """A :class:`ReqToTokenPool` whose rows each own a slot of ``mamba_pool``.

    Tensors (int64, on ``device``, row 0 all zeros):
        req_to_mamba: ``[num_slots + 1]``, the Mamba slot of each request row.
        req_to_track: ``[num_slots + 1, 2]``, each row's ping-pong track slots
            (only with ``track_buffers=True``; else None).
    A host copy of each mapping answers :meth:`mamba_slots` without a device
    read. ``alloc`` / ``fork`` / ``free`` are all-or-nothing across both pools.

    Args:
        size, max_context_len, device: as :class:`ReqToTokenPool`.
        mamba_pool: the state pool (on ``device``); it needs ``1`` slot per
            request row, ``3`` with track buffers.
        track_buffers: give each request two track slots that
            :meth:`record_track` snapshots its state into, alternately.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: DeviceLike,
        mamba_pool: MambaStatePool,
        *,
        track_buffers: bool = False,
    ) -> None:
        super().__init__(size, max_context_len, device)
        where = type(self).__name__
        if not isinstance(mamba_pool, MambaStatePool):
            raise bad_arg(f"{where}: mamba_pool", mamba_pool, "a MambaStatePool")
        if mamba_pool.device != self.device:
            expected = f"a pool on {self.device}"
            raise bad_arg(f"{where}: mamba_pool", mamba_pool.device, expected, PoolError)
        if not isinstance(track_buffers, bool):
            raise bad_arg(f"{where}: track_buffers", track_buffers, "a bool")
        self.mamba_pool = mamba_pool
        self.track_buffers = track_buffers
        rows = self.num_slots + 1
        self.req_to_mamba = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self._mamba_host = [0] * rows
        self.req_to_track: torch.Tensor | None = None
        self._track_host = [(0, 0)] * rows
        self._track_next = [0] * rows  # which of the two track slots is written next
        if track_buffers:
            self.req_to_track = torch.zeros((rows, 2), dtype=torch.int64, device=self.device)

    @property
    def slots_per_request(self) -> int:
        """Mamba slots each request row takes: 1, or 3 with track buffers."""
        return 3 if self.track_buffers else 1

    # -- state ops: the runner's pre-launch step drains the Mamba pool's queue

    @property
    def num_pending(self) -> int:
        return self.mamba_pool.num_pending

    def run_pending(self, stream: torch.cuda.Stream | None = None) -> int:
        """Run the Mamba pool's recorded ops (see :meth:`MambaStatePool.run_pending`)."""
        return self.mamba_pool.run_pending(stream)

    # -- rows

    def alloc(self, n: int) -> list[int]:
        """``n`` request rows, each with a fresh Mamba slot whose clear is recorded."""
        rows = self._alloc_rows(n)
        if rows:
            self.mamba_pool.record_clear(self.mamba_slots(rows))
        return rows

    def fork(self, parent: int, n: int) -> list[int]:
        """``n`` new rows whose state starts as ``parent``'s (a recorded copy,
        run before the next forward). Their KV mapping is not copied: the
        caller shares or copies the parent's KV slots as its cache policy says."""
        src = self.mamba_slots([self._check_row(parent, "fork: parent")])[0]
        rows = self._alloc_rows(n)
        if rows:
            self.mamba_pool.record_copy([src] * len(rows), self.mamba_slots(rows))
        return rows

    def record_copy_state(self, src_slots: Sequence[int], rows: Sequence[int]) -> None:
        """Queue ``state[slot of rows[i]] = state[src_slots[i]]``: a cached prefix
        (e.g. a track slot) donating its state to live requests."""
        targets = as_index_list(rows, "record_copy_state: rows")
        slots = self.mamba_slots(targets)
        self.mamba_pool.record_copy(src_slots, slots)

    def record_track(self, rows: Sequence[int]) -> list[int]:
        """Queue a snapshot of each row's state into its next track slot (the
        two alternate, so the previous snapshot stays whole while this one is
        written); returns the track slot each snapshot goes to."""
        if not self.track_buffers:
            expected = "a pool built with track_buffers=True"
            raise bad_arg("record_track: rows", rows, expected, PoolError)
        targets = as_index_list(rows, "record_track: rows")
        live = self._slots.check_allocated(targets, "record_track: rows", unique=True)
        dst = [self._track_host[r][self._track_next[r]] for r in live]
        self.mamba_pool.record_copy(self.mamba_slots(live), dst)
        for r in live:
            self._track_next[r] ^= 1
        return dst

    def free(self, indices: Sequence[int] | torch.Tensor) -> None:
        """Free rows and their Mamba (and track) slots; all-or-nothing. A slot
        a pending state op still uses is refused (:class:`PendingStateOp`)."""
        rows = self._slots.check_allocated(indices, "free: indices")
        busy = self.mamba_pool.pending_slots()
        for i, r in enumerate(rows):
            if busy.intersection(self._owned(r)):
                expected = "a row whose Mamba slots no pending state op uses (run_pending first)"
                raise bad_arg(f"free: indices[{i}]", r, expected, PendingStateOp)
        self.mamba_pool.free([s for r in rows for s in self._owned(r)])
        self._slots.free(rows)
        self._set_mapping(rows, [(0, 0, 0)] * len(rows))

    def clear(self) -> None:
        """Every row free, mappings zero. The Mamba pool is cleared too."""
        super().clear()
        self.mamba_pool.clear()
        self.req_to_mamba.zero_()
        self._mamba_host = [0] * len(self._mamba_host)
        self._track_host = [(0, 0)] * len(self._track_host)
        self._track_next = [0] * len(self._track_next)
        if self.req_to_track is not None:
            self.req_to_track.zero_()

    def mamba_slots(self, rows: Sequence[int] | torch.Tensor) -> list[int]:
        """The Mamba slot of each request row (host ints; row 0 -> 0)."""
        values = as_index_list(rows, "mamba_slots: rows")
        last = len(self._mamba_host) - 1
        for i, r in enumerate(values):
            if not 0 <= r <= last:
                expected = f"a request row in 0..{last}"
                raise bad_arg(f"mamba_slots: rows[{i}]", r, expected, InvalidSlot)
        return [self._mamba_host[r] for r in values]

    def track_slots(self, row: int) -> tuple[int, int]:
        """The two track slots of request row ``row`` ((0, 0) if none)."""
        return self._track_host[self._slots.check_in_range(row, "track_slots: row")]

    def _owned(self, row: int) -> list[int]:
        slots = [self._mamba_host[row]]
        if self.track_buffers:
            slots.extend(self._track_host[row])
        return slots

    def _alloc_rows(self, n: int) -> list[int]:
        n = check_count("alloc: n", n)
        need = n * self.slots_per_request
        if need > self.mamba_pool.available_size():
            available = self.mamba_pool.available_size() // self.slots_per_request
            raise PoolExhausted(n, min(available, self.available_size()), "request rows")
        rows = self._slots.alloc(n)  # raises before anything is taken
        slots = self.mamba_pool.alloc(need)
        k = self.slots_per_request
        groups = [tuple(slots[i * k : (i + 1) * k]) for i in range(n)]
        self._set_mapping(rows, [(g[0], *(g[1:] or (0, 0))) for g in groups])
        return rows

    def _set_mapping(self, rows: list[int], slots: list[tuple[int, ...]]) -> None:
        """Host and device mappings of ``rows``: (mamba, track 0, track 1) each."""
        if not rows:
            return
        for r, (main, t0, t1) in zip(rows, slots, strict=True):
            self._mamba_host[r] = main
            self._track_host[r] = (t0, t1)
            self._track_next[r] = 0
        at = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        main_slots = torch.tensor([s[0] for s in slots], dtype=torch.int64)
        self.req_to_mamba.index_copy_(0, at, main_slots.to(self.device, non_blocking=True))
        if self.req_to_track is not None:
            tracks = torch.tensor([s[1:] for s in slots], dtype=torch.int64)
            self.req_to_track.index_copy_(0, at, tracks.to(self.device, non_blocking=True))


class DecodeHybridReqToTokenPool(HybridReqToTokenPool):
    """The hybrid pool with ``pre_alloc_size`` extra rows (disaggregated decode):
    ``req_to_token``, ``req_to_mamba`` and ``req_to_track`` all have
    ``size + pre_alloc_size + 1`` rows; row 0 is padding as in the base."""

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: DeviceLike,
        mamba_pool: MambaStatePool,
        pre_alloc_size: int,
        *,
        track_buffers: bool = False,
    ) -> None:
        # Set before the base constructor, which sizes everything from num_slots.
        self.pre_alloc_size = check_count(
            "DecodeHybridReqToTokenPool: pre_alloc_size", pre_alloc_size
        )
        super().__init__(size, max_context_len, device, mamba_pool, track_buffers=track_buffers)

    @property
    def num_slots(self) -> int:
        return self.size + self.pre_alloc_size
