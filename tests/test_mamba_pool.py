"""The hybrid request pool and the runner's pre-launch step for state ops.

Mappings sized by the request pool with row 0 -> Mamba slot 0; alloc, fork,
track and free all-or-nothing; recorded ops run in order, exactly once per
step, before the forward, on every runner; no op ever lands on a freed slot;
no host sync (meta device on the CPU, sync-debug mode on a GPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphrunner import create_runner
from graphrunner.declare.buffers import BufferSpec, Index, PadRule
from graphrunner.declare.decode import MAMBA_DECODE_FIELDS, decode_buffer_specs
from graphrunner.declare.state_ops import run_state_ops
from graphrunner.pools import (
    DecodeHybridReqToTokenPool,
    DoubleFree,
    HybridReqToTokenPool,
    InvalidSlot,
    MambaStatePool,
    PendingStateOp,
    PoolError,
    PoolExhausted,
)
from graphrunner.writers.base import PopulateError

F32 = torch.float32


def hybrid(
    size: int = 3, mamba: int = 8, device: str = "cpu", track: bool = False
) -> HybridReqToTokenPool:
    pool = MambaStatePool(mamba, (2, 3), (2, 2), F32, device)
    return HybridReqToTokenPool(size, 16, device, pool, track_buffers=track)


def facts(p: HybridReqToTokenPool) -> tuple[Any, ...]:
    m = p.mamba_pool
    return (
        p.allocated(),
        m.allocated(),
        m.num_pending,
        p.req_to_mamba.tolist(),
        p.mamba_slots(list(range(p.num_slots + 1))),
        m.conv_state.clone(),
    )


def test_mappings_are_sized_by_the_request_pool_and_row_0_maps_to_slot_0() -> None:
    p = hybrid(size=3, mamba=20, track=True)
    assert p.req_to_mamba.shape == (4,) and p.req_to_track is not None
    assert p.req_to_track.shape == (4, 2)
    d = DecodeHybridReqToTokenPool(3, 16, "cpu", MambaStatePool(30, (1,), (1,), F32, "cpu"), 2)
    assert d.req_to_mamba.shape == (6,) and d.req_to_token.shape == (6, 16)
    rows = d.alloc(5)
    assert rows == [1, 2, 3, 4, 5] and d.mamba_slots([0, *rows]) == [0, 1, 2, 3, 4, 5]
    assert p.alloc(3) == [1, 2, 3]
    assert p.req_to_mamba.tolist() == [0, 1, 4, 7]  # a main slot and two track slots each
    assert p.req_to_track.tolist() == [[0, 0], [2, 3], [5, 6], [8, 9]]
    assert p.mamba_slots([0]) == [0] and p.track_slots(2) == (5, 6)


def test_alloc_records_a_clear_and_free_returns_the_slot() -> None:
    p = hybrid()
    m = p.mamba_pool
    m.conv_state.fill_(7.0)
    (row,) = p.alloc(1)
    slot = p.mamba_slots([row])[0]
    assert m.conv_state[slot].eq(7.0).all()  # recorded, not run: the scheduler touches nothing
    assert run_state_ops(p) == 1 and m.conv_state[slot].eq(0).all()
    assert m.conv_state[0].eq(7.0).all()  # the op wrote its own slot only
    p.free([row])
    assert not m.is_allocated(slot) and p.req_to_mamba.tolist() == [0, 0, 0, 0]


def test_failures_leave_both_pools_unchanged() -> None:
    p = hybrid(size=3, mamba=2)
    p.alloc(1)
    p.run_pending()
    before = facts(p)
    with pytest.raises(PoolExhausted):
        p.alloc(2)  # request rows are free, Mamba slots are not: nothing taken
    with pytest.raises(DoubleFree):
        p.free([1, 1])
    with pytest.raises(DoubleFree):
        p.free([2])
    with pytest.raises(InvalidSlot):
        p.fork(0, 1)  # row 0 is padding
    assert _equal(facts(p), before)


def test_an_op_for_a_freed_slot_is_refused_at_record_or_free_time() -> None:
    p = hybrid()
    a, b = p.alloc(2)
    p.run_pending()
    child = p.fork(a, 1)[0]
    before = facts(p)
    with pytest.raises(PendingStateOp, match="free: indices"):
        p.free([a])  # the parent's state is still to be copied
    with pytest.raises(PendingStateOp):
        p.free([child])  # the copy still writes it
    assert _equal(facts(p), before)
    p.run_pending()
    slot_b = p.mamba_slots([b])[0]
    p.free([b])
    with pytest.raises(InvalidSlot):  # recording for a freed slot: refused at once
        p.mamba_pool.record_clear([slot_b])
    with pytest.raises(InvalidSlot):
        p.mamba_pool.record_copy([slot_b], [p.mamba_slots([a])[0]])


def test_fork_copies_the_parents_state_and_ops_run_in_recorded_order() -> None:
    p = hybrid(size=4, mamba=4)
    m = p.mamba_pool
    (parent,) = p.alloc(1)
    p.run_pending()
    m.conv_state[p.mamba_slots([parent])[0]] = 3.0
    kids = p.fork(parent, 2)
    m.record_clear(p.mamba_slots([parent]))  # recorded after the copies: they still see 3.0
    assert m.num_pending == 2 and p.run_pending() == 2
    assert [m.conv_state[s].eq(3.0).all().item() for s in p.mamba_slots(kids)] == [True, True]
    assert m.conv_state[p.mamba_slots([parent])[0]].eq(0).all()


def test_track_snapshots_alternate_between_two_slots() -> None:
    p = hybrid(size=2, mamba=6, track=True)
    (row,) = p.alloc(1)
    p.run_pending()
    m, main = p.mamba_pool, p.mamba_slots([row])[0]
    t0, t1 = p.track_slots(row)
    m.ssm_state[main] = 1.0
    assert p.record_track([row]) == [t0]
    p.run_pending()
    m.ssm_state[main] = 2.0
    assert p.record_track([row]) == [t1]
    p.run_pending()
    assert m.ssm_state[t0].eq(1.0).all() and m.ssm_state[t1].eq(2.0).all()
    p.free([row])
    assert m.available_size() == 6
    with pytest.raises(PoolError, match="track_buffers=True"):
        hybrid().record_track([1])
    with pytest.raises(PoolError, match="mamba_pool"):
        HybridReqToTokenPool(2, 8, "cpu", MambaStatePool(2, (1,), (1,), F32, "meta"))
    with pytest.raises(TypeError, match="mamba_pool"):
        HybridReqToTokenPool(2, 8, "cpu", object())  # type: ignore[arg-type]


def test_a_cached_prefix_donates_its_snapshot_to_a_new_request() -> None:
    p = hybrid(size=3, mamba=9, track=True)
    (row,) = p.alloc(1)
    p.run_pending()
    m = p.mamba_pool
    m.ssm_state[p.mamba_slots([row])[0]] = 6.0
    (snap,) = p.record_track([row])  # the prefix cache keeps this snapshot
    p.run_pending()
    m.ssm_state[p.mamba_slots([row])[0]] = 7.0  # the request moves on
    (new,) = p.alloc(1)  # records a clear...
    p.record_copy_state([snap], [new])  # ...then the donation, which wins
    assert p.run_pending() == 2
    assert m.ssm_state[p.mamba_slots([new])[0]].eq(6.0).all()
    assert m.ssm_state[snap].eq(6.0).all()


def test_state_ops_run_without_a_host_sync_on_the_meta_device() -> None:
    """Any .item() / .tolist() / .cpu() of a meta tensor raises: every pool
    call and the pre-launch step complete, so none reads the device."""
    p = hybrid(size=3, mamba=9, device="meta", track=True)
    rows = p.alloc(2)
    kids = p.fork(rows[0], 1)
    p.record_track(rows)
    p.record_copy_state([p.track_slots(rows[1])[0]], kids)
    assert run_state_ops(p) == 4 and p.mamba_pool.num_pending == 0
    p.free(rows + kids)
    assert p.mamba_pool.conv_state.is_meta


def _state_forward(pool: MambaStatePool) -> Any:
    """A forward that returns the state each row's slot holds when it runs."""

    def forward(b: Any) -> torch.Tensor:
        return pool.conv_state[b.mamba_track_indices].reshape(b.input_ids.shape[0], -1) + 0.0

    return forward


class _Step:
    def __init__(self, p: HybridReqToTokenPool, rows: list[int]) -> None:
        bs = len(rows)
        self.batch_size = bs
        self.input_ids = torch.zeros(bs, dtype=torch.int64)
        self.req_pool_indices = torch.tensor(rows)
        self.req_pool_indices_cpu = self.req_pool_indices.clone()
        self.seq_lens = torch.ones(bs, dtype=torch.int64)
        self.seq_lens_cpu = self.seq_lens.clone()
        self.out_cache_loc = torch.zeros(bs, dtype=torch.int64)
        self.positions = torch.zeros(bs, dtype=torch.int64)
        self.mamba_track_indices = torch.tensor(p.mamba_slots(rows))
        self.mamba_track_mask = torch.ones(bs, dtype=torch.bool)


@pytest.mark.parametrize("kind", ["eager", "cpu"])
def test_the_runner_runs_recorded_ops_once_before_the_forward(kind: str) -> None:
    p = hybrid(size=4, mamba=4)
    m = p.mamba_pool
    specs = decode_buffer_specs(mamba=True)
    opts: dict[str, Any] = {"device": "cpu", "capture_sizes": [2], "show_progress": False}
    runner = create_runner(_state_forward(m), specs, state_ops=p, **opts, kind=kind)
    draft = create_runner(_state_forward(m), specs, state_ops=p, **opts, kind="eager")
    runner.capture()
    draft.capture()
    m.conv_state.fill_(5.0)
    rows = p.alloc(2)
    out = runner.replay(_Step(p, rows))  # graph path: the clears ran first
    assert out.eq(0).all() and runner.state_ops_run == 1
    m.conv_state[p.mamba_slots([rows[0]])[0]] = 4.0
    kid = p.fork(rows[0], 1)
    assert draft.replay(_Step(p, rows)).eq(torch.tensor([[4.0], [0.0]])).all()
    assert draft.state_ops_run == 1  # a runner over the pool drains it...
    p.mamba_pool.record_clear(p.mamba_slots(kid))
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        out = runner.replay(_Step(p, [*rows, *kid]))  # ...and the eager path (3 > 2) too
    assert out[2].eq(0).all() and runner.state_ops_run == 2 and m.num_pending == 0
    out = runner.replay(_Step(p, kid))  # nothing pending: nothing runs again
    assert runner.state_ops_run == 2 and out.eq(0).all()
    # A refused step writes nothing: its ops stay queued for the next step.
    m.conv_state.fill_(6.0)
    p.mamba_pool.record_clear(p.mamba_slots(kid))
    bad = _Step(p, kid)
    bad.input_ids = bad.input_ids.float()  # not int64: refused before any write
    with pytest.raises(PopulateError):
        runner.replay(bad)
    assert m.num_pending == 1 and m.conv_state.eq(6.0).all()
    runner.replay(_Step(p, kid))
    assert m.num_pending == 0 and runner.state_ops_run == 3
    with pytest.raises(TypeError, match="state_ops"):
        create_runner(
            _state_forward(m), specs, device="cpu", max_bs=1, state_ops=object(), kind="eager"
        )


def test_mamba_fields_are_a_declaration_option() -> None:
    names = [s.name for s in decode_buffer_specs()]
    assert "mamba_track_indices" not in names  # a Llama runner declares none
    mamba = decode_buffer_specs(mamba=True)
    assert [s for s in mamba if s.name.startswith("mamba")] == list(MAMBA_DECODE_FIELDS)
    idx, mask = MAMBA_DECODE_FIELDS
    assert idx == BufferSpec(
        "mamba_track_indices", torch.int64, PadRule.ZERO, index=True, indexes=Index.MAMBA_SLOT
    )
    assert mask.dtype == torch.bool and mask.pad_value() == 0  # pads to False


@pytest.mark.cuda
def test_state_ops_run_without_a_host_sync_on_cuda() -> None:
    p = hybrid(size=3, mamba=9, device="cuda", track=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = p.alloc(2)
        kids = p.fork(rows[0], 1)
        p.record_track(rows)
        assert run_state_ops(p) == 3
        p.free(rows + kids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


BAD_CALLS: list[tuple[str, Any, type[Exception]]] = [
    ("alloc -1", lambda p: p.alloc(-1), PoolError),
    ("alloc 1.0", lambda p: p.alloc(1.0), TypeError),
    ("alloc too many", lambda p: p.alloc(3), PoolExhausted),
    ("fork a free row", lambda p: p.fork(3, 1), InvalidSlot),
    ("fork None", lambda p: p.fork(None, 1), TypeError),
    ("fork too many", lambda p: p.fork(1, 2), PoolExhausted),
    ("free the padding row", lambda p: p.free([0]), InvalidSlot),
    ("free a free row", lambda p: p.free([3]), DoubleFree),
    ("free a row twice", lambda p: p.free([2, 2]), DoubleFree),
    ("free a str", lambda p: p.free("1"), TypeError),
    ("free a device tensor", lambda p: p.free(torch.tensor([1], device="meta")), InvalidSlot),
    ("free with a pending op", lambda p: p.free([1]), PendingStateOp),
    ("track a free row", lambda p: p.record_track([3]), DoubleFree),
    ("track a row twice", lambda p: p.record_track([2, 2]), DoubleFree),
    ("copy into a free row", lambda p: p.record_copy_state([1], [3]), InvalidSlot),
    ("copy from a free slot", lambda p: p.record_copy_state([9], [2]), InvalidSlot),
    ("mamba_slots out of range", lambda p: p.mamba_slots([5]), InvalidSlot),
    ("mamba_slots a float", lambda p: p.mamba_slots([1.0]), TypeError),
    ("track_slots of 0", lambda p: p.track_slots(0), InvalidSlot),
]


@pytest.mark.parametrize("call, error", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_and_leave_both_pools_unchanged(call: Any, error: type[Exception]) -> None:
    p = hybrid(size=4, mamba=9, track=True)
    p.alloc(2)
    p.run_pending()
    p.mamba_pool.record_clear(p.mamba_slots([1]))  # a pending op on row 1's slot
    before = facts(p)
    with pytest.raises(error):
        call(p)
    assert _equal(facts(p), before)
