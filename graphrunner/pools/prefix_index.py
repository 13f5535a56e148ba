"""The prefix index: full KV pages of token ids, keyed by a chain of hashes.

Page ``i`` of a prompt (its tokens ``i*P .. (i+1)*P - 1``, ``P`` the page
size) has the key ``hash((key of page i-1, its token ids))``, the key before
page 0 being ``hash(scope)``, as in vLLM V1: a key names the whole prefix up
to the end of its page, so a lookup walks the prompt's pages from the first
and stops at the first key it does not hold. Each entry also keeps its token
ids, its scope and the serial number of its parent entry, and a lookup
compares them: a 64-bit hash collision is a miss, never another prefix's KV.

The index only maps keys to pages; who holds a page, and when an unheld one
is evicted, is :class:`~graphrunner.pools.prefix_cache.CachedKVAllocator`'s.
Host-only: every operation is O(pages) dict operations (each hashing one
page's token ids) and reads no tensor.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from graphrunner.pools.checks import bad_arg, check_count
from graphrunner.pools.errors import InvalidSlot, PoolError

__all__ = ["CacheScope", "PrefixIndex"]

#: The parent serial of a prompt's first page: no entry has it.
_ROOT = 0


@dataclass(frozen=True, slots=True)
class CacheScope:
    """What changes a token's KV besides the tokens before it; prefixes of two
    scopes never share a page. Any hashable value serves as a scope; this one
    names the usual parts.

    Attributes:
        model: the weights' identity (a path and revision, a checksum).
        dtype: the compute dtype (``"bfloat16"``).
        kv_dtype: the KV cache's dtype (``"float16"``, ``"int8"``).
        adapter: the adapter's identity (a LoRA name and revision), or None.
    """

    model: str
    dtype: str
    kv_dtype: str
    adapter: Hashable = None


@dataclass(frozen=True, slots=True)
class _Entry:
    """One indexed page: its KV page, its key, and what the key hashed."""

    page: int
    key: int
    serial: int
    parent: int  # the parent entry's serial; _ROOT for a prompt's first page
    tokens: tuple[int, ...]
    scope: Hashable

    def holds(self, parent: int, tokens: tuple[int, ...], scope: Hashable) -> bool:
        """Whether this entry is exactly that page (not a hash collision)."""
        return self.parent == parent and self.tokens == tokens and self.scope == scope


class PrefixIndex:
    """Full pages of token ids -> KV pages, by a chain of per-page hashes.

    Args:
        page_size: tokens per page (``P``); only whole pages are indexed.

    Page ids are the KV allocator's (``slot // page_size``, ``1..num_pages``);
    page 0, the padding page, is never indexed.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = check_count("PrefixIndex: page_size", page_size, minimum=1)
        self._by_key: dict[int, _Entry] = {}
        self._by_page: dict[int, _Entry] = {}
        self._children: dict[int, set[int]] = {}  # serial -> pages indexed right below it
        self._serials = 0

    def __len__(self) -> int:
        """Indexed pages."""
        return len(self._by_page)

    def __contains__(self, page: object) -> bool:
        return page in self._by_page

    def first_unindexed(self, pages: Sequence[int]) -> int:
        """The position of the first of ``pages`` not indexed (-1: all are)."""
        for i, page in enumerate(pages):
            if page not in self._by_page:
                return i
        return -1

    def pages(self) -> frozenset[int]:
        return frozenset(self._by_page)

    def clear(self) -> None:
        self._by_key.clear()
        self._by_page.clear()
        self._children.clear()

    def full_pages(self, token_ids: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """The token ids of each full page of ``token_ids``, in order."""
        p = self.page_size
        for start in range(0, len(token_ids) - p + 1, p):
            yield tuple(token_ids[start : start + p])

    def match(self, token_ids: Sequence[int], scope: Hashable, max_pages: int) -> list[int]:
        """The KV pages of the longest indexed prefix of ``token_ids`` (full
        pages, at most ``max_pages``), in prompt order; ``[]`` on a miss."""
        out: list[int] = []
        parent, key = _ROOT, hash(scope)
        for tokens in self.full_pages(token_ids):
            if len(out) == max_pages:
                break
            key = hash((key, tokens))
            entry = self._by_key.get(key)
            if entry is None or not entry.holds(parent, tokens, scope):
                break
            out.append(entry.page)
            parent = entry.serial
        return out

    def insert(self, token_ids: Sequence[int], pages: Sequence[int], scope: Hashable) -> list[int]:
        """Index page ``i`` of ``token_ids`` as KV page ``pages[i]``, for every
        full page; returns the pages newly indexed.

        A prefix already indexed keeps its page (``pages[i]`` then stays
        unindexed: another request computed it first), and the walk goes on
        from it. A hash collision with another prefix stops the walk. All or
        nothing: ``PoolError`` if ``pages`` is short or a page is indexed under
        another prefix (it holds other tokens).
        """
        planned = self._plan(token_ids, pages, scope)
        for entry in planned:
            self._by_key[entry.key] = entry
            self._by_page[entry.page] = entry
            self._children.setdefault(entry.parent, set()).add(entry.page)
        return [e.page for e in planned]

    def _plan(
        self, token_ids: Sequence[int], pages: Sequence[int], scope: Hashable
    ) -> list[_Entry]:
        """The entries :meth:`insert` adds, every argument checked first."""
        chunks = list(self.full_pages(token_ids))
        if len(pages) < len(chunks):
            expected = f"a page for each of the {len(chunks)} full pages of token_ids"
            raise bad_arg("insert: pages", list(pages), expected, PoolError)
        planned: dict[int, _Entry] = {}  # by key: a key may repeat within one prompt
        planned_pages: set[int] = set()  # a set, not a scan of planned: O(pages) in all
        parent, key = _ROOT, hash(scope)
        checked = self._checked_pages(pages, len(chunks))
        for i, (tokens, page) in enumerate(zip(chunks, checked, strict=True)):
            key = hash((key, tokens))
            entry = planned.get(key) or self._by_key.get(key)
            if entry is not None and not entry.holds(parent, tokens, scope):
                break  # a collision: this prefix cannot be indexed past here
            if entry is None:
                if page in self._by_page or page in planned_pages:
                    expected = "a page not indexed as another prefix (it holds other tokens)"
                    raise bad_arg(f"insert: pages[{i}]", page, expected, PoolError)
                self._serials += 1
                entry = _Entry(page, key, self._serials, parent, tokens, scope)
                planned[key] = entry
                planned_pages.add(page)
            parent = entry.serial
        return list(planned.values())

    def _checked_pages(self, pages: Sequence[int], n: int) -> list[int]:
        """The first ``n`` of ``pages``, each a KV page >= 1: plain ints checked
        at once, anything else one by one, naming the first bad one."""
        first = list(pages[:n])
        if all(type(p) is int for p in first) and (not first or min(first) >= 1):
            return first
        return [self._check_page(f"insert: pages[{i}]", p) for i, p in enumerate(first)]

    def _check_page(self, name: str, page: object) -> int:
        what = "a KV page >= 1 (page 0 is the reserved padding page)"
        return check_count(name, page, minimum=1, error=InvalidSlot, what=what)

    def remove(self, page: int) -> list[int]:
        """Drop ``page`` and every page indexed below it, which no lookup could
        reach without it; returns them, ``page`` first. So no entry outlives
        its parent, and a prefix indexed again is indexed whole."""
        removed: list[int] = []
        stack = [self._by_page[page]]
        while stack:
            entry = stack.pop()
            del self._by_page[entry.page], self._by_key[entry.key]
            siblings = self._children.get(entry.parent)  # gone if the parent went first
            if siblings is not None:
                siblings.discard(entry.page)
                if not siblings:
                    del self._children[entry.parent]
            stack += [self._by_page[p] for p in self._children.pop(entry.serial, ())]
            removed.append(entry.page)
        return removed

    def inconsistencies(self) -> list[str]:
        """What breaks the index's own invariants, in words (``[]``: none):
        both maps inverse of each other, page 0 never indexed, no entry
        without its parent."""
        found = ["page 0 (the padding page) is indexed"] if 0 in self._by_page else []
        for page, entry in self._by_page.items():
            if entry.page != page or self._by_key.get(entry.key) is not entry:
                found.append(f"page {page} is indexed under a key that maps elsewhere")
        if len(self._by_key) != len(self._by_page):
            found.append(f"{len(self._by_key)} keys index {len(self._by_page)} pages")
        live = {e.serial for e in self._by_page.values()} | {_ROOT}
        for page, entry in self._by_page.items():
            if entry.parent not in live:
                found.append(f"page {page} is indexed below a page no longer indexed")
        return found
