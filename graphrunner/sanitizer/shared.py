"""The sanitizer's checks of shared KV pages (prefix caching): a step writes
no page another request holds or the prefix index lists, and every page a
live request maps is still held.

A shared page is read-only: it was filled once, by the request that
allocated it, and several requests' ``req_to_token`` rows map it since. A
write to it from one of them (a prefill started at token 0 instead of the
first uncached one, a decode slot taken from the wrong page) silently
corrupts every other. A padded row writes only slot 0 whatever the cache
holds: the tail and state checks of :mod:`graphrunner.sanitizer.padding`
refuse anything else.

These are plain functions over a :class:`SharedPages` (what
:class:`~graphrunner.pools.CachedKVAllocator` is), called by
:class:`~graphrunner.sanitizer.PaddingSanitizer` when it has one and
callable by an engine on its own. They read the device (``req_to_token``):
the sanitizer is a debug mode.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Protocol

import torch

from graphrunner.declare.decode import OUT_CACHE_LOC
from graphrunner.sanitizer.checks import PaddingViolation, row_violation

__all__ = ["SharedPages", "check_cache_consistency", "check_shared_writes", "mapped_pages"]


class SharedPages(Protocol):
    """What the checks ask a KV pool that shares pages (a
    :class:`~graphrunner.pools.CachedKVAllocator` answers all of it)."""

    @property
    def page_size(self) -> int: ...

    def refcount(self, page: int) -> int:
        """Requests holding ``page`` (0: free, or cached and unheld)."""
        ...

    def is_indexed(self, page: int) -> bool:
        """Whether ``page`` is in the prefix index (read-only)."""
        ...

    def inconsistencies(self) -> list[str]:
        """The pool's broken invariants, in words."""
        ...


def check_cache_consistency(shared: SharedPages) -> None:
    """The pool's own bookkeeping is whole: no freed page still indexed, no
    held page free, no page leaked (``PaddingViolation`` naming each)."""
    found = shared.inconsistencies()
    if found:
        raise PaddingViolation("prefix cache inconsistent: " + "; ".join(found))


def mapped_pages(
    shared: SharedPages, req_to_token: torch.Tensor, rows: Sequence[int], lens: Sequence[int]
) -> dict[int, list[int]]:
    """The KV pages the live requests map -> the request rows mapping each.

    Request ``rows[i]`` maps the pages of ``req_to_token[rows[i], :lens[i]]``.
    Each must be held by at least as many requests as map it here: a page
    with fewer references was released (and may be evicted, reallocated and
    overwritten) while a running request still reads it.
    """
    ps = shared.page_size
    mappers: dict[int, list[int]] = collections.defaultdict(list)
    width = max(lens, default=0)
    table = req_to_token[list(rows), :width].tolist() if rows and width else []
    for row, n, slots in zip(rows, lens, table, strict=False):
        for page in dict.fromkeys(s // ps for s in slots[:n]):
            mappers[page].append(row)
    for page, who in mappers.items():
        refs = shared.refcount(page)
        if page != 0 and refs < len(who):
            raise PaddingViolation(
                f"KV page {page} is mapped by request rows {who} (req_to_token) but held "
                f"by {refs}: released, evicted or freed while a running request maps it"
            )
    return dict(mappers)


def check_shared_writes(
    shared: SharedPages,
    writes: Sequence[int],
    write_rows: Sequence[int | None] | None = None,
    mappers: dict[int, list[int]] | None = None,
    *,
    field: str = OUT_CACHE_LOC,
) -> None:
    """No live write lands in a read-only page.

    Args:
        writes: the step's live KV slots (``out_cache_loc[:raw]``; slot 0,
            a step a row does not take, is the sink and passes).
        write_rows: the request row of each write, for the message.
        mappers: :func:`mapped_pages`' answer, to name who shares a page.
        field: the buffer ``writes`` came from, for the message.

    A write is refused, naming its batch row, its request row, the page and
    why, when the page is indexed or held by more than one request.
    """
    ps = shared.page_size
    for i, slot in enumerate(writes):
        page = slot // ps
        if page == 0:
            continue
        why = _read_only(shared, page, (mappers or {}).get(page, []))
        if why is not None:
            row = None if write_rows is None else write_rows[i]
            expected = f"a slot of a page only its request writes; KV page {page} is {why}"
            raise row_violation(field, i, slot, expected, row)


def _read_only(shared: SharedPages, page: int, who: list[int]) -> str | None:
    """Why ``page`` is read-only, in words, or None if its holder may write it."""
    refs = shared.refcount(page)
    if refs > 1:
        rows = f"; request rows {who} of this step map it" if who else ""
        return f"shared by {refs} requests{rows}"
    if shared.is_indexed(page):
        return "indexed (a cached prefix page: read-only once full)"
    return None
