"""Pools: slot 0 is never handed out, bookkeeping is exact, bad calls change nothing."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.pools import (
    DecodeReqToTokenPool,
    DoubleFree,
    InvalidSlot,
    KVCache,
    MambaStatePool,
    PendingStateOp,
    PoolError,
    PoolExhausted,
    ReqToTokenPool,
    SlotAllocator,
    TokenToKVPoolAllocator,
)

CTX = 6
SETTINGS = settings(max_examples=60, deadline=None)


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], Any]
    capacity: int  # slots (tokens for KV) that can be handed out
    unit: int = 1  # page size: alloc/free granularity
    first_bad: int = 0  # first out-of-range index past the end


CASES = [
    Case("slots", lambda: SlotAllocator(7), 7, first_bad=8),
    Case("req", lambda: ReqToTokenPool(6, CTX, "cpu"), 6, first_bad=7),
    Case("decode_req", lambda: DecodeReqToTokenPool(4, CTX, "cpu", pre_alloc_size=3), 7, 1, 8),
    Case("kv", lambda: TokenToKVPoolAllocator(9, "cpu"), 9, first_bad=10),
    Case("kv_paged", lambda: TokenToKVPoolAllocator(16, "cpu", page_size=4), 16, 4, 20),
    Case("mamba", lambda: MambaStatePool(5, (2, 3), (2,), torch.float32, "cpu"), 5, first_bad=6),
]
REQ_CASES = [c for c in CASES if "req" in c.name]


def tensors(pool: Any) -> dict[str, torch.Tensor]:
    names = ("req_to_token", "conv_state", "ssm_state")
    return {n: getattr(pool, n) for n in names if hasattr(pool, n)}


def snapshot(pool: Any) -> tuple[Any, ...]:
    clones = {n: t.clone() for n, t in tensors(pool).items()}
    return pool.allocated(), pool.available_size(), getattr(pool, "num_pending", 0), clones


def assert_same(pool: Any, before: tuple[Any, ...]) -> None:
    now = snapshot(pool)
    assert now[:3] == before[:3]
    for name, t in before[3].items():
        assert torch.equal(now[3][name], t), name


def groups(case: Case, live: set[int]) -> list[list[int]]:
    """Live slots in free-able units: single slots, or whole pages."""
    pages = sorted({s // case.unit for s in live})
    return [[p * case.unit + o for o in range(case.unit)] for p in pages]


def bad_frees(case: Case, live: set[int]) -> list[tuple[Any, type[Exception]]]:
    g = groups(case, live)[0] if live else []
    out: list[tuple[Any, type[Exception]]] = [
        ([0], InvalidSlot),
        ([case.first_bad], InvalidSlot),
        ([-1], InvalidSlot),
        ([1.0], TypeError),
        (["1"], TypeError),
        ([True], TypeError),
        ([None], TypeError),
        # Not a sequence: refused by type, never iterated.
        (3, TypeError),
        (None, TypeError),
        ("12", TypeError),
        ({1}, TypeError),
    ]
    if g:
        out += [
            (g + g, DoubleFree),
            (g + [0], InvalidSlot),
            (torch.tensor(g, dtype=torch.float32), InvalidSlot),
            (torch.tensor(g, device="meta"), InvalidSlot),
            (torch.tensor([g]), InvalidSlot),
            # Tensors inside a list are not host ints: refused, never read.
            ([torch.tensor(g[0])], TypeError),
            ([torch.tensor(g[0], device="meta")], TypeError),
            (np.array(g, dtype=np.float64), TypeError),
        ]
    free = [s for s in range(case.unit, case.first_bad) if s not in live]
    if free:
        out.append(([free[0]], DoubleFree))
    if case.unit > 1 and g:
        out.append((g[:-1], InvalidSlot))  # a partial page
    return out


def check_invariants(case: Case, pool: Any, live: set[int], expected: torch.Tensor | None) -> None:
    assert pool.allocated() == live
    assert 0 not in live
    assert all(case.unit <= s < case.first_bad for s in live)
    assert pool.available_size() == case.capacity - len(live)
    if expected is not None:
        assert not pool.req_to_token[0].any()
        assert torch.equal(pool.req_to_token, expected)


def step(case: Case, pool: Any, live: set[int], expected: torch.Tensor | None, data: Any) -> None:
    op = data.draw(st.sampled_from(["alloc", "free", "bad_free", "clear", "write"]))
    if op == "alloc":
        n = case.unit * data.draw(st.integers(0, case.capacity // case.unit + 1))
        if n > pool.available_size():
            before = snapshot(pool)
            with pytest.raises(PoolExhausted) as err:
                pool.alloc(n)
            assert (err.value.requested, err.value.available) == (n, pool.available_size())
            assert_same(pool, before)
            return
        got = pool.alloc(n)
        assert len(got) == len(set(got)) == n and not set(got) & live
        live.update(got)
    elif op == "free" and live:
        chosen = data.draw(st.lists(st.sampled_from(groups(case, live)), unique_by=tuple))
        slots = data.draw(st.permutations([s for g in chosen for s in g]))
        as_tensor = data.draw(st.booleans())
        pool.free(torch.tensor(slots, dtype=torch.int64) if as_tensor else slots)
        live.difference_update(slots)
    elif op == "bad_free":
        bad, error = data.draw(st.sampled_from(bad_frees(case, live)))
        before = snapshot(pool)
        with pytest.raises(error):
            pool.free(bad)
        assert_same(pool, before)
    elif op == "clear":
        pool.clear()
        live.clear()
        if expected is not None:
            expected.zero_()
    elif op == "write" and expected is not None and live:
        row = data.draw(st.sampled_from(sorted(live)))
        start = data.draw(st.integers(0, CTX))
        locs = data.draw(st.lists(st.integers(0, 99), max_size=CTX - start))
        as_tensor = data.draw(st.booleans())
        pool.write(row, start, torch.tensor(locs, dtype=torch.int64) if as_tensor else locs)
        expected[row, start : start + len(locs)] = torch.tensor(locs, dtype=torch.int32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@SETTINGS
@given(data=st.data())
def test_random_alloc_free_clear(case: Case, data: Any) -> None:
    pool = case.make()
    live: set[int] = set()
    expected = pool.req_to_token.clone() if hasattr(pool, "req_to_token") else None
    for _ in range(data.draw(st.integers(1, 25))):
        step(case, pool, live, expected, data)
        check_invariants(case, pool, live, expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_bad_free_raises_and_changes_nothing(case: Case) -> None:
    pool = case.make()
    live = set(pool.alloc(2 * case.unit))
    for bad, error in bad_frees(case, live):
        before = snapshot(pool)
        with pytest.raises(error):
            pool.free(bad)
        assert_same(pool, before)
    pool.free(groups(case, live)[0])
    with pytest.raises(DoubleFree):
        pool.free(groups(case, live)[0])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_exhaustion_reports_requested_and_available(case: Case) -> None:
    pool = case.make()
    pool.alloc(case.unit)
    before = snapshot(pool)
    n = case.capacity  # one unit more than is left
    with pytest.raises(PoolExhausted) as err:
        pool.alloc(n)
    left = case.capacity - case.unit
    assert (err.value.requested, err.value.available) == (n, left)
    assert str(n) in str(err.value) and str(left) in str(err.value)
    assert isinstance(err.value, PoolError) and isinstance(err.value, ValueError)
    with pytest.raises(ValueError):
        pool.alloc(-1)
    with pytest.raises(TypeError, match=r"alloc: n=tensor\(shape=\(\), dtype=torch.int64"):
        pool.alloc(torch.tensor(1))
    for bad in (None, 1.5, "1", True, [1]):
        with pytest.raises(TypeError, match=f"alloc: n={re.escape(repr(bad))} "):
            pool.alloc(bad)
    assert_same(pool, before)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_clear_restores_initial_state(case: Case) -> None:
    fresh, pool = case.make(), case.make()
    got = pool.alloc(case.capacity)
    assert 0 not in got and pool.available_size() == 0
    if hasattr(pool, "req_to_token"):
        pool.write(got[0], 0, [5] * CTX)
    if isinstance(pool, MambaStatePool):
        pool.conv_state[got[0]] = 1.0
        pool.record_clear([got[1]])
    pool.clear()
    assert_same(pool, snapshot(fresh))
    assert pool.alloc(case.capacity) == fresh.alloc(case.capacity)


def test_kv_paged_allocator_hands_out_whole_pages_from_page_1() -> None:
    kv = TokenToKVPoolAllocator(12, "cpu", page_size=4)
    assert kv.alloc(8) == list(range(4, 12))
    with pytest.raises(ValueError, match="multiple of page_size 4"):
        kv.alloc(3)
    assert kv.available_size() == 4 and kv.is_allocated(5) and not kv.is_allocated(2)


@pytest.mark.parametrize("case", REQ_CASES, ids=lambda c: c.name)
def test_bad_writes_raise_and_change_nothing(case: Case) -> None:
    pool = case.make()
    row = pool.alloc(1)[0]
    pool.write(row, 0, [3, 4])
    not_live = row + 1
    bad: list[tuple[Any, ...]] = [
        (0, 0, [1]),  # the padding row
        (not_live, 0, [1]),  # a row nobody owns
        (case.first_bad, 0, [1]),  # out of range
        (row, CTX - 1, [1, 2]),  # past max_context_len
        (row, -1, [1]),  # negative start
        (row, 0, torch.tensor([1.0])),  # float locs
        (row, 0, torch.tensor([[1]])),  # 2-D locs
    ]
    for args in bad:
        before = snapshot(pool)
        with pytest.raises(ValueError):
            pool.write(*args)
        assert_same(pool, before)
    assert pool.req_to_token[row, :2].tolist() == [3, 4] and not pool.req_to_token[0].any()


@pytest.mark.parametrize("case", REQ_CASES, ids=lambda c: c.name)
def test_bad_token_writes_raise_and_change_nothing(case: Case) -> None:
    pool = case.make()
    a, b = pool.alloc(2)
    bad: list[tuple[Any, type[Exception], str]] = [
        (([a], [6.9], torch.tensor([5])), TypeError, r"positions\[0\]=6.9 \(float\)"),
        (([a], [True], torch.tensor([5])), TypeError, r"positions\[0\]=True \(bool\)"),
        (([a], [-1], torch.tensor([5])), PoolError, r"positions\[0\]=-1 .*0\.\.5"),
        (([a], [CTX], torch.tensor([5])), PoolError, rf"positions\[0\]={CTX} "),
        (([a, b], [0], [7]), PoolError, "2 req_indices, 1 positions and 1 locs"),
        (([a, b], [0, 1], torch.tensor(7)), PoolError, r"locs=tensor\(shape=\(\)"),
        (([a], [1], [2**40]), PoolError, r"locs\[0\]=1099511627776 .*0\.\.2\*\*31-1"),
        (([0], [1], [3]), InvalidSlot, r"req_indices\[0\]=0 .*reserved padding"),
        ((a, [1], [3]), TypeError, r"req_indices=\d \(int\); expected a sequence"),
        (([a], None, [3]), TypeError, "positions=None"),
        (([a], [1], 3), TypeError, r"locs=3 \(int\)"),
    ]
    for args, error, match in bad:
        before = snapshot(pool)
        with pytest.raises(error, match=match):
            pool.write_tokens(*args)
        assert_same(pool, before)
    pool.write_tokens([a, b], [0, 3], [7, 9])  # host ints are fine
    assert pool.req_to_token[a, 0] == 7 and pool.req_to_token[b, 3] == 9


def test_decode_req_pool_has_pre_alloc_rows() -> None:
    pool = DecodeReqToTokenPool(4, CTX, "cpu", pre_alloc_size=3)
    assert tuple(pool.req_to_token.shape) == (8, CTX) and pool.req_to_token.dtype == torch.int32
    assert pool.alloc(7) == list(range(1, 8))


def test_pools_live_on_meta_without_reads() -> None:
    pool = ReqToTokenPool(3, CTX, "meta")
    row = pool.alloc(1)[0]
    pool.write(row, 1, torch.tensor([1, 2], device="meta"))
    pool.write_tokens([row], [4], torch.tensor([9], device="meta"))
    assert pool.req_to_token.device.type == "meta"


def test_constructor_arguments_are_checked() -> None:
    with pytest.raises(PoolError, match=r"SlotAllocator: size=0 \(int\); expected an int >= 1"):
        SlotAllocator(0)
    with pytest.raises(PoolError, match="size=10 .*expected a multiple of page_size 4"):
        TokenToKVPoolAllocator(10, "cpu", page_size=4)
    with pytest.raises(TypeError, match=r"ReqToTokenPool: max_context_len=3.0 \(float\)"):
        ReqToTokenPool(2, 3.0, "cpu")  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="KVCache: dtype=torch.int32 .*a floating torch.dtype"):
        KVCache(4, 1, 1, 2, torch.int32, "cpu")
    with pytest.raises(TypeError, match=r"MambaStatePool: conv_shape=3 \(int\)"):
        MambaStatePool(2, 3, (2,), torch.float32, "cpu")  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="device='nope'"):
        ReqToTokenPool(2, 3, "nope")


# --- KVCache -----------------------------------------------------------------


def test_kv_cache_shapes_zeros_and_set_get() -> None:
    cache = KVCache(8, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    k, v = cache.get_kv(1)
    assert tuple(k.shape) == tuple(v.shape) == (9, 2, 3) and not k.any() and not v.any()
    loc = torch.tensor([3, 0, 0, 5])  # two padded rows land on the sink slot 0
    kk, vv = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    cache.set_kv(1, loc, kk.double(), vv)  # another dtype is cast, not refused
    assert torch.allclose(k[3], kk[0]) and torch.equal(v[5], vv[3])
    assert not cache.k_buffers[0].any(), "another layer was written"
    assert torch.isfinite(k[0]).all()
    paged = KVCache(8, 1, 1, 1, torch.bfloat16, "meta", page_size=4)
    assert tuple(paged.k_buffers[0].shape) == (12, 1, 1) and paged.dtype == torch.bfloat16


def test_kv_set_kv_traces_as_one_graph() -> None:
    cache = KVCache(8, 1, 2, 3, torch.float32, "cpu")
    # fullgraph=True fails on any graph break (a host read, data-dependent validation).
    set_kv = torch.compile(cache.set_kv, backend="eager", fullgraph=True)
    k = torch.ones(2, 2, 3)
    set_kv(0, torch.tensor([2, 7]), k, 2 * k)
    assert torch.equal(cache.v_buffers[0][7], 2 * k[1])


# --- Mamba state ops -----------------------------------------------------------


def mamba(device: str = "cpu") -> MambaStatePool:
    return MambaStatePool(4, (2,), (2, 2), torch.float32, device)


def set_state(pool: MambaStatePool, slot: int, value: float) -> None:
    pool.conv_state[slot] = value
    pool.ssm_state[slot] = value


def state(pool: MambaStatePool) -> list[float]:
    return [float(x) for x in pool.conv_state[:, 0].cpu()]


@pytest.mark.parametrize(
    ("ops", "want"), [(["copy", "clear"], 0.0), (["clear", "copy"], 7.0)], ids=str
)
def test_mamba_ops_wait_for_run_pending_then_run_in_order(ops: list[str], want: float) -> None:
    pool = mamba()
    a, b = pool.alloc(2)
    set_state(pool, a, 7.0)
    set_state(pool, b, 3.0)
    for op in ops:
        pool.record_copy([a], [b]) if op == "copy" else pool.record_clear([b])
    assert state(pool)[b] == 3.0 and pool.num_pending == 2, "an op ran at record time"
    assert pool.run_pending() == 2 and pool.num_pending == 0
    assert state(pool)[b] == want and float(pool.ssm_state[b].sum()) == 4 * want
    assert pool.run_pending() == 0


def test_mamba_bad_records_raise_and_change_nothing() -> None:
    pool = mamba()
    a, b = pool.alloc(2)
    pool.record_clear([a])
    bad: list[Callable[[], None]] = [
        lambda: pool.record_clear([0]),
        lambda: pool.record_clear([b + 1]),  # not allocated
        lambda: pool.record_clear([a, a]),
        lambda: pool.record_clear(torch.tensor([a], device="meta")),
        lambda: pool.record_copy([a], [0]),
        lambda: pool.record_copy([0], [a]),
        lambda: pool.record_copy([a, b], [b]),
        lambda: pool.record_copy([a, a], [b, b]),
    ]
    for call in bad:
        before = snapshot(pool)
        with pytest.raises(PoolError):
            call()
        assert_same(pool, before)
    assert pool.run_pending() == 1


@SETTINGS
@given(data=st.data())
def test_mamba_random_ops_match_a_replica(data: Any) -> None:
    pool = mamba()
    replica = torch.zeros(5)  # conv_state[:, 0] as the ops should leave it
    pending: list[tuple[str, list[int], list[int]]] = []
    for i in range(data.draw(st.integers(1, 20))):
        live = sorted(pool.allocated())
        op = data.draw(st.sampled_from(["alloc", "free", "write", "clear", "copy", "run"]))
        if op == "alloc" and pool.available_size():
            assert 0 not in pool.alloc(1)
        elif op == "free" and live:
            slot = data.draw(st.sampled_from(live))
            if any(slot in (*src, *dst) for _, src, dst in pending):
                with pytest.raises(PendingStateOp):  # an op would land on a freed slot
                    pool.free([slot])
            else:
                pool.free([slot])
        elif op == "write" and live:  # the forward pass writing a live slot
            slot = data.draw(st.sampled_from(live))
            set_state(pool, slot, float(i + 1))
            replica[slot] = i + 1
        elif op == "clear" and live:
            dst = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            pool.record_clear(dst)
            pending.append(("clear", [], dst))
        elif op == "copy" and live:
            dst = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            src = data.draw(st.lists(st.sampled_from(live), min_size=len(dst), max_size=len(dst)))
            pool.record_copy(src, dst)
            pending.append(("copy", src, dst))
        elif op == "run":
            assert pool.run_pending() == len(pending)
            for kind, src, dst in pending:
                replica[dst] = 0.0 if kind == "clear" else replica[src].clone()
            pending.clear()
        assert state(pool) == replica.tolist() and pool.num_pending == len(pending)
        assert state(pool)[0] == 0.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mamba_run_pending_on_a_stream_never_syncs() -> None:
    pool = mamba("cuda")
    a, b = pool.alloc(2)
    set_state(pool, a, 5.0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        pool.record_copy([a], [b])
        pool.record_clear([a])
        ran = pool.run_pending(stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    assert ran == 2 and state(pool)[a] == 0.0 and state(pool)[b] == 5.0
