"""What a decode step of a model with Mamba layers adds to the plain one: each
row's Mamba slot in the step inputs (:func:`state_space_inputs`) and the
sanitizer that checks it (:class:`MambaSanitizer`)."""

from __future__ import annotations

import torch

from graphrunner import DecodeBatch, PaddingSanitizer, PaddingViolation
from graphrunner.declare import MAMBA_DECODE_FIELDS, Size
from graphrunner.phases import SpecBatch
from graphrunner.pools import HybridReqToTokenPool
from graphrunner.sanitizer import live_ints

__all__ = ["MambaSanitizer", "state_space_inputs"]


def state_space_inputs(batch: DecodeBatch, req_pool: HybridReqToTokenPool) -> SpecBatch:
    """``batch`` plus each row's Mamba slot (the decode fields of
    ``decode_buffer_specs(mamba=True)``), as one step, sealed with the batch:

    mamba_track_indices: int64 ``[bs]``, ``req_pool.mamba_slots`` of the rows
        (from the pool's host mapping: no device read).
    mamba_track_mask: bool ``[bs]``, all True (every live row advances).
    """
    slots = req_pool.mamba_slots(batch.req_pool_indices_cpu)
    host = torch.tensor(slots, dtype=torch.int64)
    return SpecBatch.extending(
        batch,
        MAMBA_DECODE_FIELDS,
        mamba_track_indices=host.to(batch.device, non_blocking=True),
        mamba_track_mask=torch.ones(len(slots), dtype=torch.bool, device=batch.device),
    )


class MambaSanitizer(PaddingSanitizer):
    """The padding sanitizer that also checks each live row's Mamba slot: the
    one its request row owns, never the sink 0, and its mask True. Build it
    with :meth:`PaddingSanitizer.for_pools` over a hybrid request pool."""

    def check_live_values(self, inputs: object, raw_bs: Size) -> None:
        super().check_live_values(inputs, raw_bs)
        assert isinstance(raw_bs, int)  # a decode step: one axis
        rows = live_ints(inputs, "req_pool_indices", raw_bs)
        slots = live_ints(inputs, "mamba_track_indices", raw_bs)
        mask = getattr(inputs, "mamba_track_mask", None)
        pool = self.req_pool
        if rows is None or slots is None or not isinstance(pool, HybridReqToTokenPool):
            return
        owned = pool.mamba_slots(rows)
        for i, (r, s, o) in enumerate(zip(rows, slots, owned, strict=True)):
            if s != o or s == 0:
                raise PaddingViolation(
                    f"mamba_track_indices batch row {i} = {s}: expected {o}, the Mamba slot "
                    f"of request row {r} (never the sink 0)"
                )
        if isinstance(mask, torch.Tensor) and not bool(mask[:raw_bs].all()):
            row = int((~mask[:raw_bs]).nonzero()[0, 0])
            raise PaddingViolation(f"mamba_track_mask batch row {row} is False: expected True")
