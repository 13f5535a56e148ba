"""Every public entry point of the pools and the batch refuses bad arguments.

Each row of the table below changes one argument of a valid call. The call
must raise a ``TypeError`` (wrong type) or the row's ``ValueError`` subclass
(``PoolError`` and its kinds, ``BatchError``: wrong value) — never an
``IndexError``, ``AttributeError`` or torch's ``RuntimeError`` — whose message
starts with the entry point, names the argument and says what was expected;
and it must change nothing: pool tensors, free lists, pending state ops, and
the batches' tensors (the same objects, the same values) are compared before
and after. NumPy integers must do exactly what Python ints do.

``GRAPHRUNNER_WRITE_RESULTS=1`` writes the per-entry-point counts to
``bench/results/bad-inputs.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from graphrunner.batch.decode_batch import BatchError, DecodeBatch
from graphrunner.pools import (
    DecodeReqToTokenPool,
    InvalidSlot,
    KVCache,
    MambaStatePool,
    PoolError,
    PoolExhausted,
    ReqToTokenPool,
    SlotAllocator,
    TokenToKVPoolAllocator,
)

CTX = 6
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "bad-inputs.md"
F32 = torch.float32


# --- the state every call runs against ----------------------------------------


@dataclass
class World:
    """One of each pool and two batches, with live rows, written state and a pending op."""

    slots: SlotAllocator
    req: ReqToTokenPool
    decode_req: DecodeReqToTokenPool
    kv: TokenToKVPoolAllocator
    kv_paged: TokenToKVPoolAllocator
    cache: KVCache
    mamba: MambaStatePool
    batch: DecodeBatch  # rows 1, 2 of `req`, prepared once
    other: DecodeBatch  # row 3 of `req`: merges cleanly into `batch`


def make_world() -> World:
    slots = SlotAllocator(7)
    slots.alloc(2)  # 1, 2
    req, kv = ReqToTokenPool(4, CTX, "cpu"), TokenToKVPoolAllocator(16, "cpu")
    for row in req.alloc(3):  # 1, 2, 3; KV slots 1..6
        req.write(row, 0, kv.alloc(2))
    decode_req = DecodeReqToTokenPool(2, CTX, "cpu", pre_alloc_size=2)
    decode_req.write(decode_req.alloc(3)[0], 0, [5, 6])
    kv_paged = TokenToKVPoolAllocator(16, "cpu", page_size=4)
    kv_paged.alloc(8)  # pages 1, 2: slots 4..11
    cache = KVCache(8, 2, 2, 3, F32, "cpu")
    cache.set_kv(0, torch.tensor([1, 2]), torch.ones(2, 2, 3), -torch.ones(2, 2, 3))
    mamba = MambaStatePool(4, (2,), (2, 2), F32, "cpu")
    mamba.alloc(2)  # 1, 2
    mamba.conv_state[1] = 1.0
    mamba.record_clear([2])
    batch = DecodeBatch.from_requests([1, 2], [2, 2], torch.tensor([7, 8]), device="cpu",
                                      max_context_len=CTX)  # fmt: skip
    batch.prepare_decode(req, kv)  # KV slots 7, 8
    other = DecodeBatch.from_requests([3], [2], torch.tensor([9]), device="cpu",
                                      max_context_len=CTX)  # fmt: skip
    return World(slots, req, decode_req, kv, kv_paged, cache, mamba, batch, other)


POOLS = ("slots", "req", "decode_req", "kv", "kv_paged", "mamba")


def tensors(w: World) -> list[torch.Tensor]:
    out = [w.req.req_to_token, w.decode_req.req_to_token, w.mamba.conv_state, w.mamba.ssm_state]
    out += [*w.cache.k_buffers, *w.cache.v_buffers]
    for b in (w.batch, w.other):
        out += [b.input_ids, b.req_pool_indices, b.seq_lens, b.out_cache_loc, b.positions]
        out += [b.req_pool_indices_cpu, b.seq_lens_cpu]
    return out


def snapshot(w: World) -> tuple[list[object], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Free lists, pending ops, and every tensor with a clone of its values."""
    pools = [getattr(w, name) for name in POOLS]
    facts: list[object] = [(p.allocated(), p.available_size()) for p in pools]
    facts.append(w.mamba.num_pending)
    return facts, [(t, t.clone()) for t in tensors(w)]


def unchanged(
    w: World, before: tuple[list[object], list[tuple[torch.Tensor, torch.Tensor]]]
) -> bool:
    facts, now = snapshot(w)
    same_tensors = all(
        t is t0 and torch.equal(t, c0) for (t, _), (t0, c0) in zip(now, before[1], strict=True)
    )
    return facts == before[0] and same_tensors


# --- the table of entry points and bad arguments --------------------------------


@dataclass(frozen=True)
class Bad:
    """Argument ``arg`` replaced by ``value`` (or ``value(world)`` if ``dynamic``)."""

    arg: str
    value: Any
    error: type[Exception]
    dynamic: bool = False

    def resolve(self, w: World) -> Any:
        return self.value(w) if self.dynamic else self.value


@dataclass(frozen=True)
class Entry:
    name: str  # table label, e.g. "ReqToTokenPool.free"
    label: str  # how its messages start, e.g. "free"
    call: Callable[..., object]  # (world, **args)
    good: Callable[[World], dict[str, Any]]
    bad: list[Bad] = field(default_factory=list)
    constructor: bool = False


def dyn(arg: str, make: Callable[[World], Any], error: type[Exception]) -> Bad:
    return Bad(arg, make, error, dynamic=True)


#: Not an int: each must be a TypeError wherever an int is expected.
NOT_INTS: list[Any] = [None, "1", b"1", 1.5, True, np.float64(1.0), np.bool_(True),
                       torch.tensor(1), [1], object()]  # fmt: skip
#: Not a sequence of indices: a TypeError, never iterated.
NOT_SEQUENCES: list[Any] = [None, 3, np.int64(3), 1.5, "12", b"\x01", True, {1}, {1: 2},
                            object()]  # fmt: skip
#: A sequence holding something that is not an int: a TypeError naming the element.
BAD_ELEMENTS: list[Any] = [[None], [1.5], ["1"], [True], [np.float64(1.0)], [torch.tensor(1)],
                           [[1]], np.array([1.5])]  # fmt: skip
#: An index tensor that is not a 1-D integer CPU tensor: a value error.
BAD_TENSORS: list[Any] = [torch.tensor([1.0]), torch.tensor([True]), torch.tensor([[1]]),
                          torch.tensor(1), torch.tensor([1], device="meta")]  # fmt: skip


def ints(arg: str, bad_values: list[Any], error: type[Exception] = PoolError) -> list[Bad]:
    return [Bad(arg, v, TypeError) for v in NOT_INTS] + [Bad(arg, v, error) for v in bad_values]


def index_lists(arg: str, bad_values: list[Any], error: type[Exception] = PoolError) -> list[Bad]:
    rows = [Bad(arg, v, TypeError) for v in NOT_SEQUENCES + BAD_ELEMENTS]
    return rows + [Bad(arg, v, error) for v in BAD_TENSORS + bad_values]


def others(arg: str, values: list[Any], error: type[Exception]) -> list[Bad]:
    return [Bad(arg, v, error) for v in values]


@dataclass(frozen=True)
class PoolCase:
    label: str
    attr: str
    live: list[int]  # one free-able unit of live slots
    free_slot: int  # in range, not allocated
    first_bad: int  # the first index past the end
    unit: int = 1


POOL_CASES = [
    PoolCase("SlotAllocator", "slots", [1], 3, 8),
    PoolCase("ReqToTokenPool", "req", [3], 4, 5),
    PoolCase("DecodeReqToTokenPool", "decode_req", [1], 4, 5),
    PoolCase("TokenToKVPoolAllocator", "kv", [1], 9, 17),
    PoolCase("TokenToKVPoolAllocator(page_size=4)", "kv_paged", [4, 5, 6, 7], 12, 20, 4),
    PoolCase("MambaStatePool", "mamba", [1], 3, 5),
]


def slot_entries(c: PoolCase) -> list[Entry]:
    """alloc / free / is_allocated, which every pool has."""
    pool = lambda w: getattr(w, c.attr)  # noqa: E731
    arg = "slots" if c.attr.startswith("kv") else "indices"
    index = "slot" if c.attr.startswith("kv") else "index"
    live, u = c.live, c.unit
    bad_frees: list[Any] = [[0], [-1], [c.first_bad], live + live, live + [0], [c.free_slot]]
    if u > 1:
        bad_frees += [live[:-1], [live[0] + 1]]  # partial pages
    exhausted = dyn("n", lambda w: pool(w).available_size() + u, PoolExhausted)
    alloc_bad = ints("n", [-1, -(2**70)] + ([3] if u > 1 else [])) + [exhausted]
    return [
        Entry(f"{c.label}.alloc", "alloc", lambda w, **a: pool(w).alloc(**a),
              lambda w: {"n": u}, alloc_bad),
        Entry(f"{c.label}.free", "free", lambda w, **a: pool(w).free(**a),
              lambda w: {arg: list(live)}, index_lists(arg, bad_frees)),
        Entry(f"{c.label}.is_allocated", "is_allocated", lambda w, **a: pool(w).is_allocated(**a),
              lambda w: {index: live[0]}, ints(index, [])),
    ]  # fmt: skip


def slot_allocator_entries() -> list[Entry]:
    return [
        Entry("SlotAllocator.check_allocated", "check_allocated",
              lambda w, **a: w.slots.check_allocated(**a), lambda w: {"indices": [1]},
              index_lists("indices", [[0], [8], [1, 1], [3]])),
        Entry("SlotAllocator.check_in_range", "check_in_range",
              lambda w, **a: w.slots.check_in_range(**a), lambda w: {"slot": 3},
              ints("slot", [0, -1, 8])),
        Entry("SlotAllocator()", "SlotAllocator", lambda w, **a: SlotAllocator(**a),
              lambda w: {"size": 4, "name": "slot"},
              ints("size", [0, -1]) + others("name", [None, 3, b"slot"], TypeError),
              constructor=True),
    ]  # fmt: skip


def req_entries(label: str, attr: str) -> list[Entry]:
    pool = lambda w: getattr(w, attr)  # noqa: E731
    write_bad = (
        ints("req_index", [0, -1, 4, 5], InvalidSlot)
        + others("start", [None, 1.5, True, "0"], TypeError)
        + others("start", [-1, CTX, 10**9], PoolError)
        + others("locs", NOT_SEQUENCES + BAD_ELEMENTS, TypeError)
        + others("locs", [[-1], [2**31], [1] * CTX, torch.tensor([1.0]), torch.tensor([[1]]),
                          torch.tensor([True]), torch.tensor(1), torch.tensor([1], device="meta")],
                 PoolError)
    )  # fmt: skip
    tokens_bad = (
        index_lists("req_indices", [[0], [4], [5], [1, 2]])
        + others("positions", [None, 3, [1.5], ["1"], [None]], TypeError)
        + others("positions", [[-1], [CTX], torch.tensor([1.0])], PoolError)
        + others("locs", [None, 9, [1.5]], TypeError)
        + others("locs", [[-1], [2**31], torch.tensor([[9]]), torch.tensor([9.0])], PoolError)
    )
    return [
        Entry(f"{label}.write", "write", lambda w, **a: pool(w).write(**a),
              lambda w: {"req_index": 1, "start": 2, "locs": [9]}, write_bad),
        Entry(f"{label}.write_tokens", "write_tokens", lambda w, **a: pool(w).write_tokens(**a),
              lambda w: {"req_indices": [1], "positions": [3], "locs": [9]}, tokens_bad),
    ]  # fmt: skip


def req_constructor_entries() -> list[Entry]:
    args = {"size": 2, "max_context_len": CTX, "device": "cpu"}
    common = (
        ints("size", [0, -1])
        + ints("max_context_len", [0])
        + others("device", [None, 3, 1.5, ["cpu"]], TypeError)
        + others("device", ["nope", "cuda:x"], PoolError)
    )
    return [
        Entry("ReqToTokenPool()", "ReqToTokenPool", lambda w, **a: ReqToTokenPool(**a),
              lambda w: dict(args), common, constructor=True),
        Entry("DecodeReqToTokenPool()", "DecodeReqToTokenPool",
              lambda w, **a: DecodeReqToTokenPool(**a),
              lambda w: {**args, "pre_alloc_size": 2}, common + ints("pre_alloc_size", [-1]),
              constructor=True),
    ]  # fmt: skip


def kv_entries() -> list[Entry]:
    kv_args = {"size": 8, "device": "cpu", "page_size": 4}
    cache_args = {"size": 8, "num_layers": 2, "num_kv_heads": 2, "head_dim": 3, "dtype": F32,
                  "device": "cpu", "page_size": 1}  # fmt: skip
    geometry = ints("size", [0, -1, 6]) + ints("page_size", [0, -1, 3])
    loc_bad = others("loc", [None, [3, 4], np.array([3, 4])], TypeError) + others(
        "loc", [torch.tensor([3, 4], dtype=torch.int32), torch.tensor([3.0, 4.0]),
                torch.tensor([[3, 4]]), torch.tensor([3, 4], device="meta"),
                torch.tensor(3)], PoolError)  # fmt: skip
    kv_bad = lambda name: others(name, [None, [[[1.0]]], np.ones((2, 2, 3))], TypeError) + others(  # noqa: E731
        name, [torch.ones(2, 2, 4), torch.ones(3, 2, 3), torch.ones(2, 2, 3, dtype=torch.int64),
               torch.ones(2, 2, 3, dtype=torch.bool), torch.ones(2, 2, 3, device="meta"),
               torch.ones(2, 6)], PoolError)  # fmt: skip
    set_good = lambda w: {"layer": 1, "loc": torch.tensor([3, 4]), "k": torch.ones(2, 2, 3),  # noqa: E731
                          "v": torch.ones(2, 2, 3)}  # fmt: skip
    return [
        Entry("TokenToKVPoolAllocator()", "TokenToKVPoolAllocator",
              lambda w, **a: TokenToKVPoolAllocator(**a), lambda w: dict(kv_args),
              geometry + others("device", [None, 0], TypeError) + others("device", ["nope"], PoolError),
              constructor=True),
        Entry("KVCache()", "KVCache", lambda w, **a: KVCache(**a), lambda w: dict(cache_args),
              ints("num_layers", [0]) + ints("head_dim", [0]) + ints("num_kv_heads", [-1])
              + others("dtype", [None, "float32", float, F32.itemsize], TypeError)
              + others("dtype", [torch.int32, torch.bool, torch.complex64], PoolError)
              + others("device", [None], TypeError) + others("device", ["nope"], PoolError),
              constructor=True),
        Entry("KVCache.set_kv", "set_kv", lambda w, **a: w.cache.set_kv(**a), set_good,
              ints("layer", [-1, 2]) + loc_bad + kv_bad("k") + kv_bad("v")),
        Entry("KVCache.get_kv", "get_kv", lambda w, **a: w.cache.get_kv(**a),
              lambda w: {"layer": 1}, ints("layer", [-1, 2, 2**70])),
    ]  # fmt: skip


def mamba_entries() -> list[Entry]:
    args = {"size": 2, "conv_shape": (2,), "ssm_shape": (2, 2), "dtype": F32, "device": "cpu"}
    shapes = lambda name: others(name, [None, 3, "2", (2.0,), (True,)], TypeError) + others(  # noqa: E731
        name, [(), (0,), (2, -1)], PoolError)  # fmt: skip
    streams = [3, "cuda", 1.5, True, object(), torch.device("cpu"), [None], {}, b"", np.int64(0)]
    return [
        Entry("MambaStatePool()", "MambaStatePool", lambda w, **a: MambaStatePool(**a),
              lambda w: dict(args),
              ints("size", [0]) + shapes("conv_shape") + shapes("ssm_shape")
              + others("dtype", [None, "float32"], TypeError)
              + others("dtype", [torch.int64, torch.bool], PoolError)
              + others("device", [None], TypeError) + others("device", ["nope"], PoolError),
              constructor=True),
        Entry("MambaStatePool.record_clear", "record_clear",
              lambda w, **a: w.mamba.record_clear(**a), lambda w: {"indices": [1]},
              index_lists("indices", [[0], [5], [3], [1, 1]])),
        Entry("MambaStatePool.record_copy", "record_copy",
              lambda w, **a: w.mamba.record_copy(**a), lambda w: {"src": [1], "dst": [2]},
              index_lists("src", [[0], [5], [3]])
              + others("dst", [None, 2, [2.0]], TypeError)
              + others("dst", [[0], [3], [2, 2], [1, 2], torch.tensor([2.0])], PoolError)),
        Entry("MambaStatePool.run_pending", "run_pending",
              lambda w, **a: w.mamba.run_pending(**a), lambda w: {"stream": None},
              others("stream", streams, TypeError)),
    ]  # fmt: skip


def from_requests_bad() -> list[Bad]:
    rows = [Bad("req_pool_indices", v, TypeError) for v in NOT_SEQUENCES] + others(
        "req_pool_indices", [[None, 2], [1.5, 2], ["1", 2], [True, 2], [torch.tensor(1), 2]],
        TypeError) + others("req_pool_indices", [[0, 2], [-1, 2], [2, 2], [1], *BAD_TENSORS],
                            BatchError)  # fmt: skip
    ids = [
        torch.tensor([7, 8], dtype=torch.int32),
        torch.tensor([7, 8, 9]),
        torch.tensor([7, 8], device="meta"),
        torch.tensor([7.0, 8.0]),
        torch.tensor(7),
    ]
    return (
        rows
        + others("seq_lens", [None, 2, [2.0, 2], ["2", 2]], TypeError)
        + others("seq_lens", [[-1, 2], [CTX + 1, 2], [2, 2, 2]], BatchError)
        + others("input_ids", [None, [7, 8], np.array([7, 8])], TypeError)
        + others("input_ids", ids, BatchError)
        + others("device", [None, 0, 1.5], TypeError)
        + others("device", ["nope"], BatchError)
        + ints("max_context_len", [0, -1], BatchError)
    )  # fmt: skip


def batch_entries() -> list[Entry]:
    prep_good = lambda w: {"req_pool": w.req, "kv_alloc": w.kv, "input_ids": None}  # noqa: E731
    ids = [
        torch.tensor([7, 8], dtype=torch.int32),
        torch.tensor([7]),
        torch.tensor([7, 8], device="meta"),
        torch.tensor([7.0, 8.0]),
    ]
    prep_bad = (
        others("req_pool", [None, 3, "req", torch.zeros(4, CTX)], TypeError)
        + [dyn("req_pool", lambda w: w.kv, TypeError), dyn("req_pool", lambda w: w.mamba, TypeError),
           dyn("req_pool", lambda w: ReqToTokenPool(4, CTX, "meta"), BatchError),
           dyn("req_pool", lambda w: ReqToTokenPool(4, CTX - 1, "cpu"), BatchError),
           dyn("req_pool", lambda w: ReqToTokenPool(4, CTX, "cpu"), BatchError),
           dyn("kv_alloc", lambda w: w.req, TypeError),
           dyn("kv_alloc", lambda w: TokenToKVPoolAllocator(1, "cpu"), PoolExhausted)]
        + others("kv_alloc", [None, 16, "kv"], TypeError)
        + others("input_ids", [[7, 8], np.array([7, 8]), 7], TypeError)
        + others("input_ids", ids, BatchError)
    )  # fmt: skip
    merge_bad = others("other", [None, 3, "b", [], (), object(), torch.zeros(2), {}],
                       TypeError) + [
        dyn("other", lambda w: w.req, TypeError),
        dyn("other", lambda w: (w.other,), TypeError),
        dyn("other", lambda w: DecodeBatch.from_requests([1], [1], torch.tensor([0]),
                                                          device="cpu", max_context_len=CTX),
            BatchError),
        dyn("other", lambda w: DecodeBatch.empty("cpu", CTX + 1), BatchError),
        dyn("other", lambda w: DecodeBatch.empty("meta", CTX), BatchError),
    ]  # fmt: skip
    geometry = (
        others("device", [None, 0, 1.5, b"cpu", ["cpu"]], TypeError)
        + others("device", ["nope"], BatchError)
        + ints("max_context_len", [0, -1], BatchError)
    )
    return [
        Entry("DecodeBatch.empty", "empty", lambda w, **a: DecodeBatch.empty(**a),
              lambda w: {"device": "cpu", "max_context_len": CTX}, geometry, constructor=True),
        Entry("DecodeBatch()", "DecodeBatch", lambda w, **a: DecodeBatch(**a),
              lambda w: {"device": "cpu", "max_context_len": CTX}, geometry, constructor=True),
        Entry("DecodeBatch.from_requests", "from_requests",
              lambda w, **a: DecodeBatch.from_requests(**a),
              lambda w: {"req_pool_indices": [1, 2], "seq_lens": [2, 2],
                         "input_ids": torch.tensor([7, 8]), "device": "cpu",
                         "max_context_len": CTX},
              from_requests_bad(), constructor=True),
        Entry("DecodeBatch.prepare_decode", "prepare_decode",
              lambda w, **a: w.batch.prepare_decode(**a), prep_good, prep_bad),
        Entry("DecodeBatch.filter", "filter", lambda w, **a: w.batch.filter(**a),
              lambda w: {"keep": [1, 0]},
              index_lists("keep", [[2], [-1], [0, 0]], BatchError)),
        Entry("DecodeBatch.merge", "merge", lambda w, **a: w.batch.merge(**a),
              lambda w: {"other": w.other}, merge_bad),
    ]  # fmt: skip


ENTRIES: list[Entry] = [
    *(e for c in POOL_CASES for e in slot_entries(c)),
    *slot_allocator_entries(),
    *req_entries("ReqToTokenPool", "req"),
    *req_entries("DecodeReqToTokenPool", "decode_req"),
    *req_constructor_entries(),
    *kv_entries(),
    *mamba_entries(),
    *batch_entries(),
]


# --- running the table -------------------------------------------------------------


@dataclass
class Tally:
    tried: int = 0
    typed: int = 0
    unchanged: int = 0
    constructor: bool = False


TALLY: dict[str, Tally] = {}


def try_bad(entry: Entry, bad: Bad) -> tuple[bool, bool, str]:
    """Run one bad call on a fresh world: (typed error, state unchanged, what went wrong)."""
    w = make_world()
    args = {**entry.good(w), bad.arg: bad.resolve(w)}
    before = snapshot(w)
    try:
        entry.call(w, **args)
    except Exception as err:  # classified below: the wrong kind fails the row
        problem = classify(entry, bad, err)
    else:
        problem = "no error"
    same = unchanged(w, before)
    return not problem, same, problem or ("" if same else "state changed")


def classify(entry: Entry, bad: Bad, err: Exception) -> str:
    """'' if ``err`` is the typed, named refusal the row expects; else why not."""
    msg = str(err)
    if not isinstance(err, bad.error):
        return f"{type(err).__name__}: {msg}"
    if isinstance(err, ValueError) and not isinstance(err, (PoolError, BatchError)):
        return f"a plain {type(err).__name__}: {msg}"
    if not (msg.startswith(f"{entry.label}: ") and bad.arg in msg and "expected" in msg):
        return f"message does not name {entry.label}, {bad.arg} and the expectation: {msg}"
    return ""


@pytest.fixture(scope="module", autouse=True)
def _write_table() -> Iterator[None]:
    yield
    if os.environ.get("GRAPHRUNNER_WRITE_RESULTS") == "1" and TALLY:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(table())


def table() -> str:
    lines = [
        "# bad inputs",
        "",
        "Each public entry point of the pools and the batch, called with one argument",
        "of a valid call replaced by a bad one (`tests/test_bad_inputs.py`). *typed",
        "errors*: a `TypeError` (wrong type) or the expected `PoolError` / `BatchError`",
        "kind (wrong value) whose message starts with the entry point and names the",
        "argument and what was expected. *state unchanged*: every pool's free list,",
        "pending state ops and tensors, and both batches' tensors (the same objects,",
        "equal values) are as before. A constructor has no state of its own (n/a).",
        "",
        "| entry point | bad inputs tried | typed errors | state unchanged |",
        "|---|---|---|---|",
    ]
    for name, t in TALLY.items():
        same = "n/a" if t.constructor else str(t.unchanged)
        lines.append(f"| `{name}` | {t.tried} | {t.typed} | {same} |")
    tried, typed = (sum(getattr(t, f) for t in TALLY.values()) for f in ("tried", "typed"))
    lines.append(f"| **{len(TALLY)} entry points** | {tried} | {typed} | |")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_each_bad_input_is_a_typed_named_error_and_changes_nothing(entry: Entry) -> None:
    tally = TALLY.setdefault(entry.name, Tally(constructor=entry.constructor))
    failures = []
    for bad in entry.bad:
        typed, same, problem = try_bad(entry, bad)
        tally.tried += 1
        tally.typed += typed
        tally.unchanged += same
        if problem:
            failures.append(f"{bad.arg}={bad.value!r}: {problem}")
    assert not failures, "\n".join(failures)


def test_every_entry_point_tries_at_least_ten_bad_inputs() -> None:
    assert {e.name: len(e.bad) for e in ENTRIES if len(e.bad) < 10} == {}


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_the_valid_call_behind_each_row_succeeds(entry: Entry) -> None:
    """Each bad row differs from this call in its one argument, so that is what is refused."""
    w = make_world()
    entry.call(w, **entry.good(w))


# --- NumPy integers are host ints --------------------------------------------------


def numpy_args(value: Any, arrays: bool) -> Any:
    """Python ints as NumPy ints: lists of ints as arrays, or as lists of NumPy ints."""
    if type(value) is int:
        return np.int64(value)
    if isinstance(value, (list, tuple)) and value and all(type(v) is int for v in value):
        return np.array(value, dtype=np.int32) if arrays else [np.int64(v) for v in value]
    return value


ATTRS = ("size", "page_size", "max_context_len", "pre_alloc_size", "num_layers", "num_kv_heads",
         "head_dim", "conv_shape", "ssm_shape", "dtype", "device", "name")  # fmt: skip


def outcome(result: object) -> object:
    """What a call returned, by value and by Python type (no NumPy int may leak out)."""
    if isinstance(result, (list, tuple)):
        return [outcome(r) for r in result]
    if isinstance(result, torch.Tensor):
        return result.tolist()
    if isinstance(result, DecodeBatch):
        return repr(result), outcome(result.max_context_len)
    if result is None or isinstance(result, (bool, int, str, torch.device, torch.dtype)):
        return type(result).__name__, result
    attrs = {a: outcome(getattr(result, a)) for a in ATTRS if hasattr(result, a)}
    return type(result).__name__, attrs


@pytest.mark.parametrize("arrays", [False, True], ids=["numpy_scalars", "numpy_arrays"])
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_numpy_ints_do_what_python_ints_do(entry: Entry, arrays: bool) -> None:
    plain, numpy = make_world(), make_world()
    want = entry.call(plain, **entry.good(plain))
    args = {k: numpy_args(v, arrays) for k, v in entry.good(numpy).items()}
    got = entry.call(numpy, **args)
    assert outcome(got) == outcome(want)
    (facts, now), (facts_np, now_np) = snapshot(plain), snapshot(numpy)
    assert facts_np == facts
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(now, now_np, strict=True))
