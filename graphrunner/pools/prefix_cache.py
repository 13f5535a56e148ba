"""KV pages shared between requests by prefix: reference counts, the prefix
index, and least-recently-used eviction of the pages nobody holds.

A page is in one of four states:

======================  =========  ==========  ===========================
state                   ``refs``   indexed     what may happen to it
======================  =========  ==========  ===========================
free                    0          no          ``alloc`` hands it out
private (being filled)  1          no          its one holder writes it
shared (read-only)      >= 1       yes         holders read it, nobody writes
cached (unheld)         0          yes         ``acquire`` or evicted (LRU)
======================  =========  ==========  ===========================

A page is written only by the request that allocated it, while it fills
it; once full it may be indexed (:meth:`CachedKVAllocator.insert`) and is
read-only from then on. Page 0 is the padding page: never handed out,
shared or indexed.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from graphrunner.pools.checks import (
    DeviceLike,
    SlotIndices,
    as_index_list,
    bad_arg,
    check_count,
    check_int,
    first_repeat,
)
from graphrunner.pools.errors import DoubleFree, InvalidSlot, PoolError, PoolExhausted
from graphrunner.pools.kv import TokenToKVPoolAllocator
from graphrunner.pools.prefix_index import PrefixIndex

__all__ = ["CachedKVAllocator", "PrefixCacheStats", "PrefixMatch"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What :meth:`CachedKVAllocator.match` found for a prompt.

    Attributes:
        pages: the cached KV pages of the prompt's first ``len(pages)`` full
            pages, in prompt order (not yet held: :meth:`~CachedKVAllocator.
            acquire` them before anything is allocated).
        cached_tokens: ``len(pages) * page_size``, always below the prompt's
            length: prefill starts at this token.
        slots: the KV slots of those tokens, ``cached_tokens`` of them in
            order: ``req_to_token[row, :cached_tokens]``.
    """

    pages: tuple[int, ...]
    cached_tokens: int
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counters for metrics (monotonic since construction) and the cache's size now.

    Attributes:
        lookups: :meth:`~CachedKVAllocator.match` calls; ``hits`` of them
            found at least one page.
        query_tokens: prompt tokens looked up; ``cached_tokens`` of them found.
        inserted_pages: pages indexed; ``evictions``: indexed pages dropped
            to make room (with the pages indexed below them).
        cached_pages: pages indexed now; ``unheld_pages`` of them held by no
            request (evictable).
    """

    lookups: int = 0
    hits: int = 0
    query_tokens: int = 0
    cached_tokens: int = 0
    inserted_pages: int = 0
    evictions: int = 0
    cached_pages: int = 0
    unheld_pages: int = 0

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        """Cached tokens over prompt tokens looked up (0.0 before any lookup)."""
        return self.cached_tokens / self.query_tokens if self.query_tokens else 0.0


class CachedKVAllocator(TokenToKVPoolAllocator):
    """A :class:`TokenToKVPoolAllocator` whose full pages can be shared by prefix.

    Until something is inserted it behaves exactly as the allocator it
    extends (``alloc`` / ``free`` / ``available_size`` / ``is_allocated``),
    so it goes wherever one goes (``DecodeBatch.prepare_decode``, the
    sanitizer). On top of that:

    * ``match(token_ids)`` -> :class:`PrefixMatch`: the cached full pages of a
      prompt's prefix (never its last token);
    * ``acquire(pages)`` -> slots: hold them (one reference each);
    * ``insert(token_ids, slots)``: index a request's full pages once written;
    * ``free(slots)`` / ``release(pages)``: drop a request's references; an
      indexed page nobody holds stays cached, least recently released first
      to go;
    * ``alloc(n)`` evicts such pages before it raises ``PoolExhausted``, and
      never evicts a held one; ``available_size()`` counts them as available.

    Args:
        size, device, page_size: as :class:`TokenToKVPoolAllocator`.
        scope: what changes the KV besides the tokens (the model, dtype, KV
            dtype: a :class:`~graphrunner.pools.prefix_index.CacheScope` or any
            hashable); ``match`` / ``insert`` take an ``adapter`` on top.

    Page ids are ``slot // page_size`` (``1..num_pages``); token slots are
    what ``req_to_token`` holds. Host-only: every call is O(pages it names,
    plus pages it evicts) and reads no tensor.
    """

    def __init__(
        self, size: int, device: DeviceLike, page_size: int = 1, *, scope: Hashable = None
    ) -> None:
        super().__init__(size, device, page_size)
        try:
            hash(scope)
        except TypeError:
            raise bad_arg("CachedKVAllocator: scope", scope, "a hashable value") from None
        self.scope = scope
        self._index = PrefixIndex(self.page_size)
        self._refs: dict[int, int] = {}  # held pages -> references (>= 1)
        self._unheld: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._counts = collections.Counter[str]()

    # -- the allocator's API, with references ---------------------------------

    def available_size(self) -> int:
        """Token slots ``alloc`` can hand out: free pages and unheld cached ones."""
        return super().available_size() + len(self._unheld) * self.page_size

    def is_allocated(self, slot: int) -> bool:
        """Whether token ``slot``'s page is held by some request (an unheld
        cached page is not: nobody may write or read it in a step)."""
        n = check_int("is_allocated: slot", slot)
        return n >= self.page_size and n // self.page_size in self._refs

    def allocated(self) -> frozenset[int]:
        """Token slots of the held pages."""
        return frozenset(self.slots_of(self._refs))

    def clear(self) -> None:
        """Every page free and unindexed (the counters of :attr:`stats` stay)."""
        super().clear()
        self._index.clear()
        self._refs.clear()
        self._unheld.clear()

    def alloc(self, n: int) -> list[int]:
        """``n`` token slots of fresh pages, each held once; evicts unheld
        cached pages (least recently released first) if too few are free.
        ``PoolExhausted`` if even that is not enough; nothing changes then."""
        n = check_count("alloc: n", n)
        if n % self.page_size:
            raise bad_arg("alloc: n", n, f"a multiple of page_size {self.page_size}", PoolError)
        if n > self.available_size():
            raise PoolExhausted(n, self.available_size(), "KV token slots")
        self._make_room(n // self.page_size)
        slots = super().alloc(n)
        for first in slots[:: self.page_size]:
            self._refs[first // self.page_size] = 1
        return slots

    def free(self, slots: SlotIndices) -> None:
        """Drop one reference on each whole page of ``slots`` (a request's
        pages, each listed once); all-or-nothing. See :meth:`release`."""
        name = "free: slots"
        tokens = as_index_list(slots, name)
        pages = self._whole_pages(tokens, name)
        self._check_held(tokens, name)
        self._drop(pages)

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference on each of ``pages`` (held, each listed once).
        A page left unheld is freed, or, if indexed, stays cached: pass a
        request's pages in prompt order, so its last pages go first."""
        self._drop(self._held_pages(pages, "release: pages"))

    def _drop(self, held: list[int]) -> None:
        for page in reversed(held):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            del self._refs[page]
            if page in self._index:
                self._unheld[page] = None  # the most recent: evicted last
            else:
                super().free(self.slots_of([page]))

    # -- sharing ---------------------------------------------------------------

    def match(self, token_ids: Sequence[int], *, adapter: Hashable = None) -> PrefixMatch:
        """The cached full pages of the longest indexed prefix of ``token_ids``
        (host ints, a prompt of ``n >= 1`` tokens): at most ``(n - 1) //
        page_size`` pages, so at least the last token is computed. Counted
        in :attr:`stats`; holds nothing (see :meth:`acquire`)."""
        tokens = self._token_ids(token_ids, "match: token_ids")
        limit = (len(tokens) - 1) // self.page_size
        pages = tuple(self._index.match(tokens, self._scope(adapter), limit))
        cached = len(pages) * self.page_size
        self._counts.update(
            lookups=1, hits=int(bool(pages)), query_tokens=len(tokens), cached_tokens=cached
        )
        return PrefixMatch(pages, cached, tuple(self.slots_of(pages)))

    def acquire(self, pages: Sequence[int]) -> list[int]:
        """Hold ``pages`` (indexed ones, each listed once: a match's) for a
        request, one reference each; returns their token slots in order.
        Call it right after :meth:`match`, before anything else allocates."""
        name = "acquire: pages"
        checked = self._page_list(pages, name)
        i = self._index.first_unindexed(checked)
        if i >= 0:
            expected = "an indexed page (evicted since the match, or never inserted)"
            raise bad_arg(f"{name}[{i}]", checked[i], expected, InvalidSlot)
        for page in checked:
            self._refs[page] = self._refs.get(page, 0) + 1
            self._unheld.pop(page, None)
        return self.slots_of(checked)

    def insert(
        self, token_ids: Sequence[int], slots: SlotIndices, *, adapter: Hashable = None
    ) -> int:
        """Index the full pages of ``token_ids``, tokens whose KV is written
        (a prompt after its last prefill chunk, or the part written so far):
        token ``j``'s KV at ``slots[j]`` (the request's ``req_to_token`` row,
        at least one slot per token of the full pages), each full page one
        whole KV page in order, held by the caller. From now on those pages
        are read-only. Pages of a prefix already indexed are left as they
        are. Returns the number of pages newly indexed; all-or-nothing."""
        tokens = self._token_ids(token_ids, "insert: token_ids", minimum=0)
        pages = self._pages_in_order(tokens, as_index_list(slots, "insert: slots"))
        added = self._index.insert(tokens, pages, self._scope(adapter))
        self._counts.update(inserted_pages=len(added))
        return len(added)

    # -- what a sanitizer or a metrics page reads --------------------------------

    @property
    def stats(self) -> PrefixCacheStats:
        """The counters and sizes now, as one frozen value."""
        c = self._counts
        return PrefixCacheStats(
            lookups=c["lookups"],
            hits=c["hits"],
            query_tokens=c["query_tokens"],
            cached_tokens=c["cached_tokens"],
            inserted_pages=c["inserted_pages"],
            evictions=c["evictions"],
            cached_pages=len(self._index),
            unheld_pages=len(self._unheld),
        )

    def refcount(self, page: int) -> int:
        """How many requests hold ``page`` (0 for a free or unheld one)."""
        return self._refs.get(check_int("refcount: page", page), 0)

    def is_indexed(self, page: int) -> bool:
        """Whether ``page`` is in the prefix index, hence read-only."""
        return check_int("is_indexed: page", page) in self._index

    def indexed_pages(self) -> frozenset[int]:
        return self._index.pages()

    def slots_of(self, pages: Iterable[int]) -> list[int]:
        """The token slots of ``pages``, in order."""
        ps = self.page_size
        if ps == 1:
            return list(pages)
        return [p * ps + o for p in pages for o in range(ps)]

    def inconsistencies(self) -> list[str]:
        """Every broken invariant of the cache, in words (``[]``: none). O(pages).

        An indexed or held page is allocated (a freed page still indexed
        would be handed out and written while others read it); an unheld
        one is exactly an indexed page with no reference; no page leaks."""
        found = self._index.inconsistencies()
        for page in sorted(self._index.pages() | set(self._refs)):
            if not self._pages.is_allocated(page):
                what = "indexed" if page in self._index else "held"
                found.append(f"page {page} is {what} but free in the allocator")
        for page in self._unheld:
            if page in self._refs or page not in self._index:
                found.append(f"page {page} is listed unheld but is held or not indexed")
        unheld = self._index.pages() - set(self._refs)
        if unheld != set(self._unheld):
            found.append(f"pages {sorted(unheld ^ set(self._unheld))} are misfiled as unheld")
        leaked = self._pages.allocated() - set(self._refs) - set(self._unheld)
        if leaked:
            found.append(f"pages {sorted(leaked)} are allocated but neither held nor cached")
        return found

    # -- private ----------------------------------------------------------------

    def _scope(self, adapter: Hashable) -> Hashable:
        return self.scope if adapter is None else (self.scope, adapter)

    def _make_room(self, pages: int) -> None:
        """Evict unheld pages, least recently released first, until ``pages``
        are free. Evicting a page drops the pages indexed below it too: an
        unheld one is freed, a held one stays with its holders, unindexed."""
        while super().available_size() < pages * self.page_size:
            for page in self._index.remove(next(iter(self._unheld))):
                self._counts["evictions"] += 1
                if page in self._unheld:
                    del self._unheld[page]
                    super().free(self.slots_of([page]))

    def _page_list(self, pages: Sequence[int], name: str) -> list[int]:
        """``pages`` as host ints, each a page in ``1..num_pages``, listed once."""
        checked = as_index_list(pages, name)
        if checked and (min(checked) < 1 or max(checked) > self._pages.size):
            for i, page in enumerate(checked):
                self._pages.check_in_range(page, f"{name}[{i}]")
        i = -1 if len(set(checked)) == len(checked) else first_repeat(checked)
        if i >= 0:
            raise bad_arg(f"{name}[{i}]", checked[i], "each page listed once", DoubleFree)
        return checked

    def _held_pages(self, pages: Sequence[int], name: str) -> list[int]:
        checked = self._page_list(pages, name)
        for i, page in enumerate(checked):
            if page not in self._refs:
                expected = "a page some request holds (it is free or only cached)"
                raise bad_arg(f"{name}[{i}]", page, expected, DoubleFree)
        return checked

    def _token_ids(self, token_ids: object, name: str, minimum: int = 1) -> list[int]:
        tokens = as_index_list(token_ids, name, error=PoolError)
        if len(tokens) < minimum:
            raise bad_arg(name, tokens, f"at least {minimum} token id", PoolError)
        return tokens

    def _pages_in_order(self, tokens: list[int], slots: list[int]) -> list[int]:
        """The page of each full page of ``tokens``: ``slots`` of page ``i``
        are exactly one held page's, in order."""
        ps, full = self.page_size, len(tokens) // self.page_size
        if len(slots) < full * ps:
            expected = f"at least {full * ps} slots (one per token of the full pages)"
            raise bad_arg("insert: slots", slots, expected, PoolError)
        pages = [slot // ps for slot in slots[: full * ps : ps]]
        if (pages and min(pages) < 1) or slots[: full * ps] != self.slots_of(pages):
            for i, page in enumerate(pages):  # name the first page that is not whole
                if page < 1 or slots[i * ps : (i + 1) * ps] != self.slots_of([page]):
                    span = f"{i * ps}..{(i + 1) * ps - 1}"
                    expected = f"slots {span} one whole KV page >= 1, in order"
                    raise bad_arg(f"insert: slots[{i * ps}]", slots[i * ps], expected, InvalidSlot)
        if not self._refs.keys() >= set(pages):
            self._check_held(slots[: full * ps], "insert: slots")
        return pages

    def _check_held(self, slots: list[int], name: str) -> None:
        """Each of ``slots`` in a page some request holds (else ``DoubleFree``)."""
        for i, slot in enumerate(slots):
            if slot // self.page_size not in self._refs:
                expected = "a slot of a page some request holds (it is free or only cached)"
                raise bad_arg(f"{name}[{i}]", slot, expected, DoubleFree)
