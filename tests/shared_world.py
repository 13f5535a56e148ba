"""A world of shared KV pages for the prefix-caching tests: the toy decode
model over a paged KV cache whose full pages :class:`CachedKVAllocator`
shares between requests by prefix, admitted as an engine would (hold the
hit, compute only the uncached tokens, index the full pages)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner import BufferSpec, GraphRunner, create_runner, decode_buffer_specs
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.pools import CachedKVAllocator, KVCache, ReqToTokenPool, whole_pages
from graphrunner.sanitizer.padding import PaddingSanitizer
from graphrunner.testing import ToyDecodeModel

P = 4  # tokens per page
PAGES = 40
CONTEXT = 64
REQUESTS = 10
VOCAB = 50


class SharedWorld:
    """Pools, the toy model and the requests' slots (host bookkeeping)."""

    def __init__(self) -> None:
        self.req_pool = ReqToTokenPool(REQUESTS, CONTEXT, "cpu")
        self.cache = CachedKVAllocator(PAGES * P, "cpu", P, scope="toy")
        self.kv = KVCache(PAGES * P, 1, 2, 8, torch.float32, "cpu", page_size=P)
        self.model = ToyDecodeModel(self.req_pool, self.kv, vocab=VOCAB)
        self.slots: dict[int, list[int]] = {}

    def reset(self) -> None:
        self.req_pool.clear()
        self.cache.clear()
        for t in (*self.kv.k_buffers, *self.kv.v_buffers):
            t.zero_()
        self.slots.clear()

    def prefill(self, tokens: list[int]) -> int:
        """Admit ``tokens`` at their first uncached token: hold the hit,
        allocate the rest, write the uncached KV, index the full pages.
        Returns the request's row."""
        (row,) = self.req_pool.alloc(1)
        hit = self.cache.match(tokens)
        slots = self.cache.acquire(hit.pages)
        slots += self.cache.alloc(whole_pages(len(tokens), P) - hit.cached_tokens)
        self.req_pool.write(row, 0, slots[: len(tokens)])
        new = torch.arange(hit.cached_tokens, len(tokens))
        k = self.model.kv_of(torch.tensor(tokens)[new], new)
        self.kv.set_kv(0, torch.tensor(slots)[new], k, -k)
        self.cache.insert(tokens, slots)
        self.slots[row] = slots
        return row

    def finish(self, row: int) -> None:
        self.cache.free(self.slots.pop(row))
        self.req_pool.free([row])

    def decode(
        self, rows: Sequence[int], lens: Sequence[int], ids: Sequence[int] | None = None
    ) -> DecodeBatch:
        """A prepared decode step of ``rows`` at lengths ``lens``."""
        tokens = torch.tensor(list(ids) if ids is not None else [7] * len(rows))
        batch = DecodeBatch.from_requests(
            list(rows), list(lens), tokens, device="cpu", max_context_len=CONTEXT
        )
        batch.prepare_decode(self.req_pool, self.cache)
        return batch

    def sanitizer(self) -> PaddingSanitizer:
        sanitizer = PaddingSanitizer.for_pools(self.req_pool, self.kv, kv_allocator=self.cache)
        assert sanitizer.shared_pages is self.cache  # a cache as the allocator is checked
        return sanitizer

    def runner(
        self, specs: list[BufferSpec] | None = None, sizes: Sequence[int] = (4,)
    ) -> GraphRunner:
        """An eager runner of the toy decode, captured at ``sizes``, sanitized."""
        runner = create_runner(
            self.model,
            specs or decode_buffer_specs(),
            device="cpu",
            capture_sizes=list(sizes),
            show_progress=False,
            sanitizer=self.sanitizer(),
            kind="eager",
        )
        runner.capture()
        return runner
