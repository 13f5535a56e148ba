"""DecodeBatch: host mirrors track device tensors, and no step reads the device.

The random sequences run in lockstep on the CPU (values checked) and on the
``meta`` device (every read of a meta value raises, so finishing proves that no
step reads a device tensor back), and on CUDA under sync-debug "error" mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from graphrunner.batch.decode_batch import BatchError, DecodeBatch
from graphrunner.declare.inputs import StepInputs
from graphrunner.pools import PoolExhausted, ReqToTokenPool, TokenToKVPoolAllocator

L = 6  # max_context_len
DEVICE_FIELDS = ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions")
VALUE_KINDS = (  # a BatchError
    "filter_out_of_range", "filter_negative", "filter_dup", "merge_overlap", "merge_ctx",
    "from_row0", "from_dup_rows", "from_len_mismatch", "from_too_long", "from_negative",
    "from_ids_int32", "from_ids_shape", "prepare_ids_int32", "prepare_ids_shape",
)  # fmt: skip
TYPE_KINDS = (  # a TypeError
    "filter_int", "filter_none", "merge_none", "from_float_len", "from_ids_list",
    "prepare_no_pool",
)  # fmt: skip
BAD_KINDS = VALUE_KINDS + TYPE_KINDS


@dataclass
class Req:
    row: int
    slots: list[int]  # KV slots of the cached tokens, by position
    input_id: int
    owned: list[int]  # KV slots it holds: whole pages, freed together
    loc: int = 0  # out_cache_loc; 0 until prepared
    pos: int = 0


def whole_pages(n: int, page: int) -> int:
    """Slots that hold ``n`` tokens in whole pages."""
    return -(-n // page) * page


@dataclass
class Sim:
    """A batch and its pools on one device, next to a host model of the requests."""

    device: torch.device
    page: int = 1
    req_pool: ReqToTokenPool = field(init=False)
    kv: TokenToKVPoolAllocator = field(init=False)
    batch: DecodeBatch = field(init=False)
    model: list[Req] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.req_pool = ReqToTokenPool(5, L, self.device)
        pages = 16 if self.page == 1 else 5  # paged: few enough pages to run out
        self.kv = TokenToKVPoolAllocator(pages * self.page, self.device, page_size=self.page)
        self.batch = DecodeBatch.empty(self.device, L)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def ids(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def add(self, lens: list[int], ids: list[int], replace_if_idle: bool) -> None:
        with self.no_sync():
            rows = self.req_pool.alloc(len(lens))
            owned = [self.kv.alloc(whole_pages(n, self.page)) for n in lens]
            slots = [o[:n] for o, n in zip(owned, lens, strict=True)]
            for row, s in zip(rows, slots, strict=True):
                self.req_pool.write(row, 0, s)
            new = DecodeBatch.from_requests(
                rows, lens, self.ids(ids), device=self.device, max_context_len=L
            )
            if replace_if_idle and self.batch.is_empty():
                self.batch = new
            else:
                self.batch.merge(new)
        self.model += [Req(r, s, i, o) for r, s, i, o in zip(rows, slots, ids, owned, strict=True)]

    def prepare(self, ids: list[int] | None) -> None:
        error: type[Exception] | None = None
        starting = [r for r in self.model if len(r.slots) % self.page == 0]
        if any(len(r.slots) + 1 > L for r in self.model):
            error = BatchError
        elif self.kv.available_size() < len(starting) * self.page:
            error = PoolExhausted
        call = lambda: self.batch.prepare_decode(  # noqa: E731
            self.req_pool, self.kv, None if ids is None else self.ids(ids)
        )
        event(f"prepare: {'ok' if error is None else error.__name__}")
        if error is not None:
            self.expect_unchanged(call, error)
            return
        before = self.kv.allocated()
        with self.no_sync():
            call()
        # Lowest-first pages, handed in row order to the rows that start one;
        # the others continue after their last token.
        fresh = iter(sorted(self.kv.allocated() - before))
        for i, req in enumerate(self.model):
            if len(req.slots) % self.page == 0:
                page = [next(fresh) for _ in range(self.page)]
                req.owned += page
                slot = page[0]
            else:
                slot = req.slots[-1] + 1
            req.pos, req.loc = len(req.slots), slot
            req.slots.append(slot)
            req.input_id = req.input_id if ids is None else ids[i]

    def filter(self, keep: list[int]) -> None:
        gone = [r for i, r in enumerate(self.model) if i not in keep]
        with self.no_sync():
            self.batch.filter(keep)
            for req in gone:  # the finished requests give their slots back
                self.req_pool.free([req.row])
                self.kv.free(req.owned)
        self.model = [self.model[i] for i in keep]

    def merge_empty(self) -> None:
        with self.no_sync():
            self.batch.merge(DecodeBatch.empty(self.device, L))

    def idle(self) -> None:
        if self.batch.is_empty():
            with self.no_sync():
                self.batch = DecodeBatch.empty(self.device, L)

    def bad(self, kind: str) -> None:
        error = TypeError if kind in TYPE_KINDS else BatchError
        self.expect_unchanged(self.bad_call(kind), error)

    def bad_call(self, kind: str) -> Callable[[], object]:
        bs, dev, b = self.batch.batch_size, self.device, self.batch
        live = self.model[0].row if self.model else 1

        def new(rows: list[int], lens: list[int], ids: torch.Tensor) -> Callable[[], object]:
            return lambda: DecodeBatch.from_requests(rows, lens, ids, device=dev, max_context_len=L)

        calls: dict[str, Callable[[], object]] = {
            "filter_out_of_range": lambda: b.filter([bs]),
            "filter_negative": lambda: b.filter([-1]),
            "filter_dup": lambda: b.filter([0, 0]),
            "merge_overlap": lambda: b.merge(new([live], [1], self.ids([0]))()),  # type: ignore[arg-type]
            "merge_ctx": lambda: b.merge(DecodeBatch.empty(dev, L + 1)),
            "from_row0": new([0], [1], self.ids([0])),
            "from_dup_rows": new([2, 2], [1, 1], self.ids([0, 0])),
            "from_len_mismatch": new([1, 2], [1], self.ids([0, 0])),
            "from_too_long": new([1], [L + 1], self.ids([0])),
            "from_negative": new([1], [-1], self.ids([0])),
            "from_ids_int32": new([1], [1], self.ids([0], torch.int32)),
            "from_ids_shape": new([1], [1], self.ids([0, 0])),
            "prepare_ids_int32": lambda: b.prepare_decode(
                self.req_pool, self.kv, self.ids([0] * bs, torch.int32)
            ),
            "prepare_ids_shape": lambda: b.prepare_decode(
                self.req_pool, self.kv, self.ids([0] * (bs + 1))
            ),
            "filter_int": lambda: b.filter(0),  # type: ignore[arg-type]
            "filter_none": lambda: b.filter(None),  # type: ignore[arg-type]
            "merge_none": lambda: b.merge(None),  # type: ignore[arg-type]
            "from_float_len": new([1], [1.0], self.ids([0])),  # type: ignore[list-item]
            "from_ids_list": new([1], [1], [0]),  # type: ignore[arg-type]
            "prepare_no_pool": lambda: b.prepare_decode(self.kv, self.kv),  # type: ignore[arg-type]
        }
        if kind == "merge_overlap" and not self.model:
            return calls["merge_ctx"]
        return calls[kind]

    def snapshot(self) -> list[Any]:
        tensors = [getattr(self.batch, f) for f in DEVICE_FIELDS]
        tensors += [self.batch.req_pool_indices_cpu, self.batch.seq_lens_cpu]
        tensors.append(self.req_pool.req_to_token)
        pools = [self.kv.allocated(), self.req_pool.allocated(), self.batch]
        return pools + [(t, t.clone()) for t in tensors]

    def expect_unchanged(
        self, call: Callable[[], object], error: type[Exception], match: str | None = None
    ) -> None:
        before = self.snapshot()
        with pytest.raises(error, match=match), self.no_sync():
            call()
        after = self.snapshot()
        assert after[:3] == before[:3]
        for (t_before, clone), (t_after, _) in zip(before[3:], after[3:], strict=True):
            assert t_after is t_before, "a failing call replaced a tensor"
            if t_after.device.type != "meta":
                assert torch.equal(t_after, clone)

    def check(self) -> None:
        b, m = self.batch, self.model
        assert isinstance(b, StepInputs) and b.batch_size == len(m)
        assert b.req_pool_indices_cpu.tolist() == [r.row for r in m]
        assert b.seq_lens_cpu.tolist() == [len(r.slots) for r in m]
        for mirror in (b.req_pool_indices_cpu, b.seq_lens_cpu):
            assert mirror.device.type == "cpu" and mirror.dtype == torch.int64
        for name in DEVICE_FIELDS:
            t = getattr(b, name)
            assert t.device.type == self.device.type and t.dtype == torch.int64, name
            assert tuple(t.shape) == (len(m),), name
        assert self.req_pool.allocated() == {r.row for r in m}
        assert self.kv.allocated() == {s for r in m for s in r.owned}
        if self.device.type != "meta":
            self.check_values()

    def check_values(self) -> None:
        b, m = self.batch, self.model
        assert torch.equal(b.req_pool_indices.cpu(), b.req_pool_indices_cpu)
        assert torch.equal(b.seq_lens.cpu(), b.seq_lens_cpu)
        assert b.input_ids.tolist() == [r.input_id for r in m]
        assert b.out_cache_loc.tolist() == [r.loc for r in m]
        assert b.positions.tolist() == [r.pos for r in m]
        rtt = self.req_pool.req_to_token.cpu()
        assert not rtt[0].any(), "row 0 (padding) was written"
        for r in m:
            assert rtt[r.row, : len(r.slots)].tolist() == r.slots
            if r.loc:  # prepared: the new token sits at the last position
                assert r.pos == len(r.slots) - 1 and rtt[r.row, r.pos] == r.loc


def draw_op(data: Any, sim: Sim) -> tuple[str, tuple[Any, ...]]:
    bs = len(sim.model)
    op = data.draw(st.sampled_from(["add", "add", "prepare", "prepare", "filter", "merge_empty",
                                    "idle", "bad"]))  # fmt: skip
    if op == "add":
        k = data.draw(st.integers(0, min(3, sim.req_pool.available_size())))
        lens = data.draw(st.lists(st.integers(0, L), min_size=k, max_size=k))
        if sum(whole_pages(n, sim.page) for n in lens) > sim.kv.available_size():
            return "idle", ()
        ids = data.draw(st.lists(st.integers(0, 999), min_size=k, max_size=k))
        return "add", (lens, ids, data.draw(st.booleans()))
    if op == "prepare":
        ids = st.lists(st.integers(0, 999), min_size=bs, max_size=bs)
        return "prepare", (data.draw(st.none() | ids),)
    if op == "filter":
        return "filter", (data.draw(st.lists(st.sampled_from(range(bs)), unique=True))
                          if bs else [],)  # fmt: skip
    if op == "bad":
        return "bad", (data.draw(st.sampled_from(BAD_KINDS)),)
    return op, ()


def run_random_ops(data: Any, devices: list[str], page: int = 1) -> None:
    sims = [Sim(torch.device(d), page) for d in devices]
    for _ in range(data.draw(st.integers(1, 20))):
        op, args = draw_op(data, sims[0])
        for sim in sims:
            getattr(sim, op)(*args)
            sim.check()


@pytest.mark.parametrize("page", [1, 4])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_ops_keep_mirrors_exact_and_never_read_the_device(page: int, data: Any) -> None:
    run_random_ops(data, ["cpu", "meta"], page)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("page", [1, 4])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_random_ops_on_cuda_under_sync_debug_error(page: int, data: Any) -> None:
    run_random_ops(data, ["cpu", "cuda"], page)


# --- explicit cases ------------------------------------------------------------


def prefilled(device: str = "cpu") -> tuple[ReqToTokenPool, TokenToKVPoolAllocator, DecodeBatch]:
    req_pool, kv = ReqToTokenPool(4, L, device), TokenToKVPoolAllocator(16, device)
    rows = req_pool.alloc(2)
    for row in rows:
        req_pool.write(row, 0, kv.alloc(2))
    ids = torch.tensor([7, 8]).to(device)
    batch = DecodeBatch.from_requests(rows, [2, 2], ids, device=device, max_context_len=L)
    return req_pool, kv, batch


def test_from_requests_placeholders_then_prepare() -> None:
    req_pool, kv, batch = prefilled()
    assert batch.out_cache_loc.tolist() == [0, 0] and batch.positions.tolist() == [0, 0]
    batch.prepare_decode(req_pool, kv, torch.tensor([3, 4]))
    assert batch.positions.tolist() == [2, 2] and batch.seq_lens_cpu.tolist() == [3, 3]
    assert batch.out_cache_loc.tolist() == [5, 6] and batch.input_ids.tolist() == [3, 4]
    assert req_pool.req_to_token[[1, 2], 2].tolist() == [5, 6]


def test_paged_prepare_continues_a_page_or_starts_one() -> None:
    req_pool, kv = ReqToTokenPool(4, L, "cpu"), TokenToKVPoolAllocator(16, "cpu", page_size=4)
    rows = req_pool.alloc(2)
    first, second = kv.alloc(4), kv.alloc(4)  # pages 1 and 2: slots 4..7, 8..11
    req_pool.write(rows[0], 0, first[:3])  # 3 tokens: room left in its page
    req_pool.write(rows[1], 0, second)  # 4 tokens: its page is full
    ids = torch.tensor([7, 8])
    batch = DecodeBatch.from_requests(rows, [3, 4], ids, device="cpu", max_context_len=L)
    batch.prepare_decode(req_pool, kv)
    assert batch.out_cache_loc.tolist() == [7, 12]  # after slot 6; page 3 starts at 12
    assert req_pool.req_to_token[rows, [3, 4]].tolist() == [7, 12]
    assert kv.allocated() == set(range(4, 16))
    batch.prepare_decode(req_pool, kv)  # now the first row starts a page, the second continues
    assert batch.out_cache_loc.tolist() == [16, 13] and batch.positions.tolist() == [4, 5]


def test_empty_batch() -> None:
    batch = DecodeBatch.empty("meta", L)
    assert batch.is_empty() and batch.batch_size == 0 and isinstance(batch, StepInputs)
    req_pool, kv = ReqToTokenPool(2, L, "meta"), TokenToKVPoolAllocator(4, "meta")
    batch.prepare_decode(req_pool, kv)
    batch.filter([])
    assert batch.is_empty() and kv.available_size() == 4


def test_cpu_batch_never_aliases_its_host_mirrors() -> None:
    _, _, batch = prefilled()
    assert batch.seq_lens.data_ptr() != batch.seq_lens_cpu.data_ptr()
    assert batch.req_pool_indices.data_ptr() != batch.req_pool_indices_cpu.data_ptr()


def _pools(ctx: int = L, device: str = "cpu", rows: int = 2):
    """Pools like ``prefilled``'s (its rows 1 and 2 allocated unless rows=0)."""
    req_pool = ReqToTokenPool(4, ctx, device)
    req_pool.alloc(rows)
    return req_pool, TokenToKVPoolAllocator(16, "cpu")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _pools(device="meta"), "req_pool is on meta; expected cpu"),
        (lambda: _pools(ctx=L - 1), f"req_pool.max_context_len {L - 1} is below"),
        (lambda: _pools(rows=0), "request 1 is not allocated"),
    ],
    ids=["pool_device", "pool_narrower", "rows_not_allocated"],
)
def test_prepare_with_wrong_pools_changes_nothing(
    make: Callable[[], tuple[ReqToTokenPool, TokenToKVPoolAllocator]], match: str
) -> None:
    _, _, batch = prefilled()
    req_pool, kv = make()
    sim = Sim(torch.device("cpu"))
    sim.batch, sim.req_pool, sim.kv = batch, req_pool, kv
    sim.expect_unchanged(lambda: batch.prepare_decode(req_pool, kv), BatchError, match)


def test_prepare_past_context_names_the_row() -> None:
    req_pool, kv, batch = prefilled()
    for _ in range(L - 2):
        batch.prepare_decode(req_pool, kv)
    with pytest.raises(BatchError, match=r"row 0 \(request 1\): seq_len 6 \+ 1"):
        batch.prepare_decode(req_pool, kv)


def test_from_requests_refuses_device_sequences() -> None:
    with pytest.raises(BatchError, match=r"req_pool_indices=tensor\(.*device=meta\).* on cpu"):
        DecodeBatch.from_requests(
            torch.tensor([1], device="meta"), [1], torch.zeros(1, dtype=torch.int64),  # type: ignore[arg-type]
            device="cpu", max_context_len=L,
        )  # fmt: skip
    with pytest.raises(BatchError, match=r"input_ids=tensor\(.*device=meta\).*on cpu"):
        DecodeBatch.from_requests(
            [1], [1], torch.zeros(1, dtype=torch.int64, device="meta"), device="cpu",
            max_context_len=L,
        )  # fmt: skip


def test_prepare_when_kv_is_exhausted_changes_nothing() -> None:
    sim = Sim(torch.device("cpu"))
    sim.add([2, 2], [7, 8], True)
    sim.kv.alloc(sim.kv.available_size() - 1)  # one slot left for two rows
    sim.expect_unchanged(lambda: sim.batch.prepare_decode(sim.req_pool, sim.kv), PoolExhausted)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda b: b.filter(0), TypeError,
         r"^filter: keep=0 \(int\); expected a sequence of row indices"),
        (lambda b: b.filter([0.0]), TypeError, r"^filter: keep\[0\]=0.0 \(float\); expected an int"),
        (lambda b: b.filter([2]), BatchError, r"^filter: keep\[0\]=2 \(int\); expected a row index in 0..1"),
        (lambda b: b.filter([1, 1]), BatchError, r"^filter: keep=\[1, 1\] \(list\); expected each row"),
        (lambda b: b.merge(None), TypeError, r"^merge: other=None \(NoneType\); expected a DecodeBatch"),
        (lambda b: b.prepare_decode(None, None), TypeError, r"^prepare_decode: req_pool=None"),
    ],
    ids=["filter_int", "filter_float", "filter_range", "filter_dup", "merge_none", "prepare_none"],
)  # fmt: skip
def test_bad_arguments_are_named_with_value_and_expectation(
    call: Callable[[DecodeBatch], object], error: type[Exception], match: str
) -> None:
    req_pool, kv, batch = prefilled()
    sim = Sim(torch.device("cpu"))
    sim.batch, sim.req_pool, sim.kv = batch, req_pool, kv
    sim.expect_unchanged(lambda: call(batch), error, match)


def test_numpy_ints_are_host_ints_as_in_the_pools() -> None:
    ids = torch.tensor([7, 8])
    plain = DecodeBatch.from_requests([1, 2], [2, 3], ids, device="cpu", max_context_len=L)
    for rows, lens in [
        ([np.int64(1), np.int32(2)], [np.int64(2), np.uint8(3)]),
        (np.array([1, 2]), np.array([2, 3], dtype=np.int32)),
    ]:
        batch = DecodeBatch.from_requests(
            rows,
            lens,
            ids,
            device="cpu",
            max_context_len=np.int64(L),  # type: ignore[arg-type]
        )
        assert repr(batch) == repr(plain) and batch.max_context_len == L
        batch.filter(np.array([1]))  # type: ignore[arg-type]
        assert batch.req_pool_indices_cpu.tolist() == [2]
    req_pool = ReqToTokenPool(np.int64(3), np.int64(L), "cpu")  # type: ignore[arg-type]
    assert req_pool.alloc(np.int64(2)) == [1, 2]  # type: ignore[arg-type]
