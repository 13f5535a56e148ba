"""The prefix cache (:class:`CachedKVAllocator`, :class:`PrefixIndex`) against
plain models: without inserts it is the allocator it extends, call for call;
with them, a dict of whole-prefix keys, a reference count per page and a
list of unheld pages in release order predict every answer, slot and
counter, and no held page is ever evicted."""

from __future__ import annotations

import random
import time
from collections.abc import Hashable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.pools import (
    CachedKVAllocator,
    CacheScope,
    DoubleFree,
    InvalidSlot,
    PoolError,
    PoolExhausted,
    PrefixCacheStats,
    PrefixIndex,
    TokenToKVPoolAllocator,
    whole_pages,
)
from graphrunner.pools import prefix_index as prefix_index_module

P = 4  # tokens per page
PAGES = 10
SETTINGS = settings(max_examples=80, deadline=None)
#: Prompts share these prefixes (3 pages each) so that lookups hit.
PREFIXES = ([1] * 12, [1] * 8 + [2] * 4, list(range(12)))


class Model:
    """The pool as plain dicts: ``index`` maps ``(adapter, every token up to
    the page's end)`` to the page, so a prefix is its own key (no hashing)."""

    def __init__(self, pages: int) -> None:
        self.free = set(range(1, pages + 1))
        self.refs: dict[int, int] = {}
        self.index: dict[tuple[Hashable, tuple[int, ...]], int] = {}
        self.unheld: list[int] = []  # least recently released first
        self.evictions = 0

    def available(self) -> int:
        return (len(self.free) + len(self.unheld)) * P

    def key(self, adapter: Hashable, tokens: Sequence[int], i: int) -> tuple[Hashable, tuple]:
        return adapter, tuple(tokens[: (i + 1) * P])

    def alloc(self, n: int) -> list[int]:
        if n // P > len(self.free) + len(self.unheld):
            raise PoolExhausted(n, self.available())
        while len(self.free) < n // P:
            self.evict(self.unheld[0])
        pages = sorted(self.free)[: n // P]
        for page in pages:
            assert page not in self.refs
            self.free.remove(page)
            self.refs[page] = 1
        return [p * P + o for p in pages for o in range(P)]

    def evict(self, page: int) -> None:
        """``page`` and every indexed prefix that extends its own."""
        (adapter, prefix) = next(k for k, v in self.index.items() if v == page)
        for k, v in list(self.index.items()):
            if k[0] == adapter and k[1][: len(prefix)] == prefix:
                del self.index[k]
                self.evictions += 1
                if v in self.unheld:
                    self.unheld.remove(v)
                    self.free.add(v)

    def release(self, pages: Sequence[int]) -> None:
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                if page in self.index.values():
                    self.unheld.append(page)
                else:
                    self.free.add(page)

    def match(self, tokens: Sequence[int], adapter: Hashable) -> list[int]:
        pages = []
        for i in range((len(tokens) - 1) // P):
            page = self.index.get(self.key(adapter, tokens, i))
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.refs[page] = self.refs.get(page, 0) + 1
            if page in self.unheld:
                self.unheld.remove(page)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], adapter: Hashable) -> int:
        added = 0
        for i in range(len(tokens) // P):
            key = self.key(adapter, tokens, i)
            if key not in self.index:
                self.index[key] = pages[i]
                added += 1
        return added


def agree(cache: CachedKVAllocator, model: Model) -> None:
    assert cache.inconsistencies() == []
    assert cache.available_size() == model.available()
    assert {p: cache.refcount(p) for p in range(1, PAGES + 1) if cache.refcount(p)} == model.refs
    assert cache.indexed_pages() == frozenset(model.index.values())
    stats = cache.stats
    assert (stats.cached_pages, stats.unheld_pages) == (len(model.index), len(model.unheld))
    assert stats.evictions == model.evictions
    assert cache.allocated() == frozenset(cache.slots_of(model.refs))


class Request:
    def __init__(self, tokens: list[int], slots: list[int], adapter: Hashable) -> None:
        self.tokens, self.slots, self.adapter = tokens, slots, adapter

    @property
    def pages(self) -> list[int]:
        return [s // P for s in self.slots[::P]]


def admit(cache: CachedKVAllocator, model: Model, tokens: list[int], adapter: Hashable) -> Any:
    """Match, hold the hit, allocate the rest (the hit released again if
    that fails); the request, or None when the pool refused it."""
    hit = cache.match(tokens, adapter=adapter)
    assert list(hit.pages) == model.match(tokens, adapter)
    assert hit.cached_tokens == len(hit.pages) * P < len(tokens)
    assert list(hit.slots) == cache.slots_of(hit.pages)
    assert cache.acquire(hit.pages) == list(hit.slots)
    model.acquire(hit.pages)
    need = whole_pages(len(tokens), P) - hit.cached_tokens
    try:
        want = model.alloc(need)
    except PoolExhausted:
        with pytest.raises(PoolExhausted):
            cache.alloc(need)
        cache.release(hit.pages)
        model.release(hit.pages)
        return None
    assert cache.alloc(need) == want
    return Request(tokens, [*hit.slots, *want], adapter)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "fill", "finish"]),
        st.integers(0, len(PREFIXES) - 1),  # which prefix
        st.integers(1, 14),  # prompt length
        st.sampled_from([None, "lora"]),  # adapter
        st.integers(0, 7),  # which request
    ),
    max_size=60,
)


def run_trace(ops: list[tuple[str, int, int, Any, int]]) -> CachedKVAllocator:
    """Play ``ops`` on the cache and the model, comparing after each; at the
    end every request finishes and every page must be free or cached."""
    cache, model = CachedKVAllocator(PAGES * P, "cpu", P, scope="m"), Model(PAGES)
    running: list[Request] = []
    for op, prefix, length, adapter, which in ops:
        if op == "admit":
            req = admit(cache, model, (PREFIXES[prefix] + [7, 8, 9])[:length], adapter)
            running += [req] if req is not None else []
        elif op == "fill" and running:
            req = running[which % len(running)]
            got = cache.insert(req.tokens, req.slots, adapter=req.adapter)
            assert got == model.insert(req.tokens, req.pages, req.adapter)
        elif op == "finish" and running:
            req = running.pop(which % len(running))
            cache.free(req.slots)
            model.release(req.pages)
        agree(cache, model)
    for req in running:
        cache.free(req.slots)
        model.release(req.pages)
    agree(cache, model)
    assert cache.allocated() == frozenset() and cache.available_size() == PAGES * P
    assert cache.stats.lookups == sum(op == "admit" for op, *_ in ops)
    return cache


@SETTINGS
@given(OPS)
def test_the_cache_is_the_plain_model(ops: list[tuple[str, int, int, Any, int]]) -> None:
    cache = run_trace(ops)
    assert len(cache.alloc(PAGES * P)) == PAGES * P  # every cached page evictable
    assert cache.stats.cached_pages == 0 and cache.inconsistencies() == []


def test_a_long_trace_hits_evicts_and_refuses_as_the_model_does() -> None:
    rng = random.Random(72)
    kinds = ["admit", "admit", "fill", "fill", "finish"]
    ops = [
        (rng.choice(kinds), rng.randrange(3), rng.randint(1, 14), rng.choice([None, "lora"]), i)
        for i in range(600)
    ]
    stats = run_trace(ops).stats
    # The trace reaches every path the model checks: hits, misses, evictions.
    assert stats.hits > 50 and stats.misses > 50 and stats.evictions > 20


@SETTINGS
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 9)), max_size=30))
def test_without_inserts_it_is_the_allocator_it_extends(ops: list[tuple[bool, int, int]]) -> None:
    """Call for call: the same slots, the same refusals (type and message)."""
    old, new = TokenToKVPoolAllocator(PAGES * P, "cpu", P), CachedKVAllocator(PAGES * P, "cpu", P)
    held: list[list[int]] = []
    for is_alloc, pages, which in ops:
        if is_alloc:
            outcomes = [_outcome(pool.alloc, pages * P) for pool in (old, new)]
            if isinstance(outcomes[0], list):
                held.append(outcomes[0])
        else:
            slots = held.pop(which % len(held)) if held and which < 7 else [P * (which + 1)]
            outcomes = [_outcome(pool.free, slots) for pool in (old, new)]
        assert outcomes[0] == outcomes[1]
        assert (old.allocated(), old.available_size()) == (new.allocated(), new.available_size())
        assert all(old.is_allocated(s) == new.is_allocated(s) for s in range(-1, PAGES * P + P))


def _outcome(call: Any, arg: Any) -> Any:
    try:
        return call(arg)
    except (PoolError, TypeError) as e:
        return type(e), str(e)


def filled(cache: CachedKVAllocator, tokens: list[int], adapter: Hashable = None) -> list[int]:
    """A request that computed ``tokens`` from scratch and indexed its pages."""
    slots = cache.alloc(whole_pages(len(tokens), P))
    cache.insert(tokens, slots, adapter=adapter)
    return slots


def test_a_match_never_covers_the_last_token() -> None:
    cache = CachedKVAllocator(PAGES * P, "cpu", P)
    filled(cache, list(range(12)))
    assert cache.match(list(range(12))).cached_tokens == 8  # 3 full pages: the last recomputed
    assert cache.match(list(range(9))).cached_tokens == 8
    assert cache.match(list(range(8))).cached_tokens == 4
    assert cache.match(list(range(4))).cached_tokens == 0
    assert cache.match([0]).pages == ()
    assert cache.match(list(range(7)) + [99, 8]).pages == (1,)  # diverges in page 2


def test_scopes_and_adapters_never_share() -> None:
    cache = CachedKVAllocator(PAGES * P, "cpu", P, scope=CacheScope("m", "bfloat16", "float16"))
    filled(cache, list(range(9)), adapter="lora-a")
    assert cache.match(list(range(9)), adapter="lora-a").pages == (1, 2)
    assert cache.match(list(range(9)), adapter="lora-b").pages == ()
    assert cache.match(list(range(9))).pages == ()
    with pytest.raises(TypeError, match=r"scope=\[\] \(list\); expected a hashable value"):
        CachedKVAllocator(8, "cpu", scope=[])


def test_a_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key equal: the entries' own tokens, scope and parent decide."""
    monkeypatch.setattr(prefix_index_module, "hash", lambda value: 0, raising=False)
    cache = CachedKVAllocator(PAGES * P, "cpu", P)
    filled(cache, [1] * 9)
    assert cache.match([1] * 9).pages == (1,)  # page 2 collides with page 1: not indexed
    assert cache.match([2] * 9).pages == ()
    assert cache.match([1] * 9, adapter="x").pages == ()


def test_exhaustion_evicts_least_recently_released_last_pages_first() -> None:
    cache = CachedKVAllocator(4 * P, "cpu", P)
    a = filled(cache, list(range(13)))  # pages 1, 2, 3 indexed, 4 private
    b = cache.alloc(0)
    cache.free(a)
    assert cache.stats.unheld_pages == 3 and cache.available_size() == 4 * P
    # The private page 4 is free at once; then the last page released goes first.
    assert cache.alloc(P) == cache.slots_of([4])
    assert cache.alloc(P) == cache.slots_of([3])
    assert cache.match(list(range(13))).pages == (1, 2)
    hit = cache.acquire([1])  # held now: never evicted
    assert cache.alloc(P) == cache.slots_of([2])
    with pytest.raises(PoolExhausted, match=r"alloc: n=4: requested 4 KV token slots, only 0"):
        cache.alloc(P)
    assert cache.refcount(1) == 1 and cache.is_indexed(1) and b == []
    assert cache.stats == PrefixCacheStats(
        lookups=1, hits=1, query_tokens=13, cached_tokens=8, inserted_pages=3, evictions=2,
        cached_pages=1, unheld_pages=0,
    )  # fmt: skip
    cache.release([1])
    assert cache.allocated() == frozenset(cache.slots_of([2, 3, 4])) and hit == [4, 5, 6, 7]


def test_evicting_a_page_drops_the_pages_indexed_below_it() -> None:
    cache = CachedKVAllocator(4 * P, "cpu", P)
    first = filled(cache, list(range(9)))  # pages 1, 2 indexed, 3 private
    cache.free(first[:P])  # page 1 released first: least recent
    cache.free(first[P:])  # page 3 freed, page 2 unheld
    cache.acquire([2])  # page 2 held alone (below an unheld page 1)
    assert cache.alloc(3 * P) == cache.slots_of([1, 3, 4])  # evicts page 1, unindexes 2
    assert cache.indexed_pages() == frozenset() and cache.refcount(2) == 1
    assert cache.stats.evictions == 2 and cache.inconsistencies() == []
    cache.release([2])  # no longer indexed: freed, not cached
    assert cache.available_size() == P and cache.stats.unheld_pages == 0


def test_a_prefix_two_requests_computed_is_indexed_once() -> None:
    cache = CachedKVAllocator(PAGES * P, "cpu", P)
    a = cache.alloc(8)
    b = cache.alloc(8)
    assert cache.insert([5] * 8, a) == 2
    assert cache.insert([5] * 8, b) == 0  # b's pages stay private
    cache.free(b)
    assert cache.available_size() == (PAGES - 2) * P and cache.match([5] * 9).pages == (1, 2)
    cache.free(a)
    with pytest.raises(DoubleFree, match=r"free: slots\[0\]=4 .*a page some request holds"):
        cache.free(a)  # cached, held by nobody


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda c: c.acquire([3]),
            InvalidSlot,
            r"acquire: pages\[0\]=3 .*expected an indexed page",
        ),
        (lambda c: c.acquire([0]), InvalidSlot, r"acquire: pages\[0\]=0 .*0 is the reserved"),
        (lambda c: c.acquire([1, 1]), DoubleFree, r"acquire: pages\[1\]=1 .*each page listed once"),
        (
            lambda c: c.release([5]),
            DoubleFree,
            r"release: pages\[0\]=5 .*a page some request holds",
        ),
        (lambda c: c.free([12, 13, 14, 15]), DoubleFree, r"free: slots\[0\]=12 .*allocated page"),
        (lambda c: c.insert([1] * 4, [1, 2, 3, 0]), InvalidSlot, r"insert: slots\[0\]=1 .*whole"),
        (lambda c: c.insert([1] * 4, [0, 1, 2, 3]), InvalidSlot, r"insert: slots\[0\]=0 .*>= 1"),
        (lambda c: c.insert([1] * 8, [8, 9, 10, 11]), PoolError, r"insert: slots=.*at least 8"),
        (
            lambda c: c.insert([1] * 4, [12, 13, 14, 15]),
            DoubleFree,
            r"insert: slots\[0\]=12 .*holds",
        ),
        (lambda c: c.match([]), PoolError, r"match: token_ids=\[\] .*at least 1 token id"),
        (lambda c: c.alloc(3), PoolError, r"alloc: n=3 .*a multiple of page_size 4"),
    ],
)
def test_bad_calls_name_the_argument_and_change_nothing(call: Any, error: type, message: str):
    cache = CachedKVAllocator(PAGES * P, "cpu", P)
    slots = filled(cache, [1] * 8)  # pages 1, 2 indexed and held
    cache.free(cache.alloc(P))  # page 3 free again
    before = (cache.allocated(), cache.indexed_pages(), cache.stats, cache.available_size())
    with pytest.raises(error, match=message):
        call(cache)
    assert (cache.allocated(), cache.indexed_pages(), cache.stats, cache.available_size()) == before
    assert slots == list(range(4, 12)) and cache.inconsistencies() == []


def test_page_zero_is_never_indexed_and_clear_keeps_the_counters() -> None:
    index = PrefixIndex(P)
    with pytest.raises(InvalidSlot, match=r"insert: pages\[0\]=0 .*padding page"):
        index.insert([1] * 4, [0], "s")
    cache = CachedKVAllocator(PAGES * P, "cpu", P)
    filled(cache, [3] * 5)
    cache.match([3] * 5)
    cache.clear()
    assert cache.available_size() == PAGES * P and cache.indexed_pages() == frozenset()
    assert (cache.stats.lookups, cache.stats.cached_pages) == (1, 0)
    assert cache.stats.hit_rate == 4 / 5 and cache.stats.misses == 0


def test_the_consistency_check_sees_a_freed_page_still_indexed() -> None:
    cache = CachedKVAllocator(PAGES * P, "cpu", P)
    slots = filled(cache, [1] * 5)
    cache.free(slots)
    TokenToKVPoolAllocator.free(cache, cache.slots_of([1]))  # a planted bug: bypasses the cache
    assert cache.inconsistencies() == ["page 1 is indexed but free in the allocator"]


def test_lookups_and_inserts_cost_pages_not_the_pool() -> None:
    """A long prompt over a large pool: one dict probe per page (counted)."""
    cache = CachedKVAllocator(4096 * P, "cpu", P)
    tokens = [random.Random(0).randrange(50) for _ in range(400)]
    filled(cache, tokens)
    probes = []
    original = dict.get

    class Counting(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            probes.append(key)
            return original(self, key, default)

    index = cache._index  # noqa: SLF001 - the test counts the index's probes
    index._by_key = Counting(index._by_key)  # noqa: SLF001
    assert cache.match(tokens).cached_tokens == 396
    assert len(probes) == 99


def test_the_index_alone_matches_inserts_and_removes_subtrees() -> None:
    index = PrefixIndex(2)
    assert index.insert([1, 2, 3, 4, 5], [7, 8], "s") == [7, 8]  # token 5: no full page
    assert index.insert([1, 2, 3, 4, 9, 9], [5, 6, 4], "s") == [4]  # 7, 8 kept for the prefix
    assert index.match([1, 2, 3, 4, 9, 9], "s", max_pages=9) == [7, 8, 4]
    assert index.match([1, 2, 3, 4, 9, 9], "s", max_pages=2) == [7, 8]
    assert index.match([1, 2, 3, 4], "t", max_pages=9) == []
    with pytest.raises(PoolError, match=r"insert: pages\[0\]=8 .*not indexed as another prefix"):
        index.insert([5, 5], [8], "s")
    assert index.remove(8) == [8, 4] and len(index) == 1 and 7 in index
    assert index.inconsistencies() == []
    assert index.insert([1, 2, 3, 4, 9, 9], [7, 2, 3], "s") == [2, 3]  # indexed whole again
    assert index.match([1, 2, 3, 4, 9, 9, 0], "s", max_pages=9) == [7, 2, 3]


def test_indexing_a_long_fresh_prompt_costs_its_pages_not_their_square() -> None:
    """20,000 fresh pages of one token, indexed in one insert: each page once
    (0.3 s on a 2-vCPU Xeon); a scan of the pages planned so far for each
    page, as once, took 200 million steps (7.7 s there)."""
    n = 20_000
    cache = CachedKVAllocator(n + 1, "cpu", 1)
    tokens = [random.Random(1).randrange(1, 50_000) for _ in range(n)]
    slots = cache.alloc(n)
    start = time.perf_counter()
    assert cache.insert(tokens, slots) == n
    took = time.perf_counter() - start
    assert took < 2.0, f"indexing {n} pages took {took:.1f} s"
    assert cache.match(tokens + [7]).cached_tokens == n
