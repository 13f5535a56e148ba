"""Planted bugs of prefix caching, each caught by the sanitizer at replay:
a live row writing a shared page or an indexed one, a page mapped by more
running requests than hold it (released, evicted, reallocated), a freed
page still indexed; a padded row still writes only slot 0.

The world: the toy decode model over a paged KV cache whose pages
:class:`CachedKVAllocator` shares; request A filled a prompt's pages, B
shares its first two, an eager runner captured at size 4 replays them
padded under :class:`PaddingSanitizer`."""

from __future__ import annotations

import re

import pytest
import torch
from shared_world import P, SharedWorld

from graphrunner import BufferSpec, PadRule, decode_buffer_specs
from graphrunner.declare.buffers import StepSize
from graphrunner.phases import token_batch_phase
from graphrunner.phases.token_batch import token_batch_inputs
from graphrunner.pools import TokenToKVPoolAllocator
from graphrunner.sanitizer import check_shared_writes
from graphrunner.sanitizer.padding import PaddingSanitizer, PaddingViolation

PROMPT_A = list(range(9))  # pages 1, 2 full and indexed; page 3 holds token 8
PROMPT_B = list(range(8)) + [20, 21]  # shares pages 1, 2


@pytest.fixture
def world() -> SharedWorld:
    return SharedWorld()


def test_requests_sharing_a_prefix_replay_cleanly(world: SharedWorld) -> None:
    runner = world.runner()
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    assert world.slots[b][:8] == world.slots[a][:8]  # pages 1 and 2 shared
    assert (world.cache.refcount(1), world.cache.refcount(3)) == (2, 1)
    batch = world.decode([a, b], [9, 10])
    expected = world.model(batch).clone()
    got = runner.replay(batch)
    assert torch.equal(got, expected)
    assert runner.sanitizer.stats.replays_checked == 1


def test_a_live_row_writing_a_shared_page_is_refused(world: SharedWorld) -> None:
    """B admitted at token 2 instead of its first uncached token (8): its
    next slot is in page 1, which A holds too."""
    runner = world.runner()
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    batch = world.decode([a, b], [9, 2])
    message = (
        f"out_cache_loc batch row 1 (request row {b}) = 6: expected a slot of a page only "
        f"its request writes; KV page 1 is shared by 2 requests; request rows [{a}, {b}] "
        "of this step map it"
    )
    with pytest.raises(PaddingViolation, match=re.escape(message)):
        runner.replay(batch)


def test_a_live_row_writing_an_indexed_page_is_refused(world: SharedWorld) -> None:
    """A alone holds its pages, but page 2 is indexed: full, hence read-only."""
    runner = world.runner()
    a = world.prefill(list(range(8)))
    batch = world.decode([a], [7])  # recomputes token 7, in page 2
    message = "= 11: expected a slot of a page only its request writes; KV page 2 is indexed"
    with pytest.raises(PaddingViolation, match=re.escape(message)):
        runner.replay(batch)


def test_a_freed_page_still_indexed_is_refused(world: SharedWorld) -> None:
    runner = world.runner()
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    world.cache.free(world.slots.pop(a))
    world.req_pool.free([a])
    # Planted: page 2 returned to the free list behind the cache's back.
    TokenToKVPoolAllocator.free(world.cache, world.cache.slots_of([2]))
    with pytest.raises(PaddingViolation, match="page 2 is indexed but free in the allocator"):
        runner.replay(world.decode([b], [10]))


def test_a_page_released_while_mapped_is_refused(world: SharedWorld) -> None:
    """B drops its references to the shared pages early (A has finished):
    page 1 is unheld, evictable, though B still reads it."""
    runner = world.runner()
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    world.cache.free(world.slots.pop(a))
    world.cache.release([1, 2])  # planted
    message = f"KV page 1 is mapped by request rows [{b}] (req_to_token) but held by 0"
    with pytest.raises(PaddingViolation, match=re.escape(message)):
        runner.replay(world.decode([b], [10]))


def test_a_page_evicted_and_reallocated_while_mapped_is_refused(world: SharedWorld) -> None:
    """Pool pressure evicts B's prefix (released early) and hands it to C,
    which now fills it while B reads it."""
    runner = world.runner()
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    world.cache.free(world.slots.pop(a))
    world.cache.release([1, 2])  # planted
    (c,) = world.req_pool.alloc(1)
    cache = world.cache
    others = cache.alloc(cache.available_size() - cache.stats.unheld_pages * P)  # every free page
    slots = cache.alloc(2 * P)  # evicts pages 2 and 1, the last released first
    assert cache.stats.evictions == 2 and slots == cache.slots_of([1, 2]) and others
    world.req_pool.write(c, 0, slots[:-1])
    message = f"KV page 1 is mapped by request rows [{b}, {c}] (req_to_token) but held by 1"
    with pytest.raises(PaddingViolation, match=re.escape(message)):
        runner.replay(world.decode([b, c], [10, len(slots) - 1]))


def test_a_padded_row_writing_a_shared_slot_is_still_refused(world: SharedWorld) -> None:
    """A pad rule declared wrongly (a shared slot instead of 0) passes the
    tail check; the state check catches the write."""
    shared_slot = 5  # token 1 of the prefix, page 1
    specs = [
        BufferSpec("out_cache_loc", torch.int64, PadRule.FILL, fill_value=shared_slot)
        if s.name == "out_cache_loc"
        else s
        for s in decode_buffer_specs()
    ]
    runner = world.runner(specs)
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    with pytest.raises(PaddingViolation, match=f"k_cache\\[0\\] KV slot {shared_slot} changed"):
        runner.replay(world.decode([a, b], [9, 10]))


def test_a_prompt_chunk_writing_a_shared_page_is_refused(world: SharedWorld) -> None:
    """A token batch (prefill) of B started at token 6, inside the shared
    page 2: refused on the token axis, naming B's request row."""
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    specs = token_batch_phase(world.model.forward_token_batch, max_requests=2).specs
    sanitizer = PaddingSanitizer(req_pool=world.req_pool, kv_allocator=world.cache)
    ok = token_batch_inputs(
        input_ids=[8, 20, 21], out_cache_loc=world.slots[b][8:10] + [world.slots[a][8]],
        req_pool_indices=[b, a], seq_lens=[10, 9], extend_lens=[2, 1],
    )  # fmt: skip
    sanitizer.snapshot(ok, StepSize(3, 2), specs=specs)
    bad = token_batch_inputs(
        input_ids=[6, 7, 20, 21], out_cache_loc=world.slots[b][6:10], req_pool_indices=[b],
        seq_lens=[10], extend_lens=[4],
    )  # fmt: skip
    message = f"out_cache_loc batch row 0 (request row {b}) = 10: expected a slot of a page"
    with pytest.raises(PaddingViolation, match=re.escape(message)):
        sanitizer.snapshot(bad, StepSize(4, 1), specs=specs)


def test_the_check_is_a_plain_call_an_engine_can_make(world: SharedWorld) -> None:
    a, b = world.prefill(PROMPT_A), world.prefill(PROMPT_B)
    own = world.slots[b][8]
    check_shared_writes(world.cache, [0, own, world.slots[a][8]])  # the sink, private pages
    with pytest.raises(
        PaddingViolation, match=r"out_cache_loc batch row 1 = 4: .*page 1 is shared"
    ):
        check_shared_writes(world.cache, [own, 4])
    plain = PaddingSanitizer(kv_allocator=TokenToKVPoolAllocator(8, "cpu"))
    assert plain.shared_pages is None  # no cache, no shared-page check
