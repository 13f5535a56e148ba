"""The padding fuzz's shared-prefix phase: decode steps of requests whose
first pages are shared by prefix (with each other and with bystanders),
replayed by :func:`padding_fuzz.fuzz` at every live size with every poison
pattern in every padded tail, sanitized and lean; the bystander index
values the fuzz plants there are slots of shared pages (slot 0 itself is
not poisoned here: see the case).

Clean, it finds nothing. With a planted bug it finds it: a live row
admitted inside its cached prefix (its next slot in a shared page), and a
freed page still indexed, are refused by the sanitizer on every replay;
the lean path's own comparisons cannot see either (the live row writes
where its ``req_to_token`` says), which is why the sanitizer checks them.

Eager only: the case is about pools and inputs, and the mechanisms are
fuzzed over the same buffers by ``test_padding_fuzz.py``."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from shared_world import CONTEXT, PAGES, REQUESTS, VOCAB, P, SharedWorld

from fuzz_cases import FuzzCase
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.pools import TokenToKVPoolAllocator
from padding_fuzz import PATTERNS, fuzz

SIZES = [1, 2, 4]
#: Two prompts' first two pages, shared by whoever starts with them.
PREFIX_PAGES = 2


class SharedPrefixCase(FuzzCase):
    """Decode over shared pages. ``plant``: None, ``"shared_write"`` (the
    first live row decodes at token 2, inside its cached prefix) or
    ``"freed_indexed"`` (an unheld cached page freed behind the cache)."""

    def __init__(self, plant: str | None = None) -> None:
        self.phase, self.plant = "shared_prefix_decode", plant
        self.world = SharedWorld()
        self.runner = self.world.runner(sizes=SIZES)
        self.forward = self.world.model
        self.vocab = VOCAB
        self.sinks = {"k": [0], "v": [0]}
        # NOTE: the toy attends over its whole req_to_token row, masked, so
        # its columns past a length read slot 0 with weight 0: a NaN there
        # would be 0 * NaN. Slot 0 is not poisoned; writes to it still are
        # checked (a sink).
        self.padding_reads: dict[str, list[int]] = {}
        self._bystander = 1

    def inputs(self, raw_bs: int, seed: int) -> DecodeBatch:
        rng, w = random.Random(seed), self.world
        w.reset()
        prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX_PAGES * P)] for _ in range(2)]
        done = w.prefill(prefixes[1] + [1, 2, 3, 4, 5])  # pages of its own, cached when it ends
        self._bystander = w.prefill(prefixes[0] + [rng.randrange(VOCAB)])
        w.finish(done)
        rows, lens = [], []
        for _ in range(raw_bs):
            tokens = rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
            rows.append(w.prefill(tokens))
            lens.append(len(tokens))
        if self.plant == "shared_write":
            lens[0] = 2
        if self.plant == "freed_indexed":
            held = {p for p in range(PAGES + 1) if w.cache.refcount(p)}
            unheld = sorted(w.cache.indexed_pages() - held)
            TokenToKVPoolAllocator.free(w.cache, w.cache.slots_of(unheld[:1]))
        ids = [rng.randrange(VOCAB) for _ in rows]
        return w.decode(rows, lens, ids)

    def state(self) -> dict[str, torch.Tensor]:
        w = self.world
        return {
            "req_to_token": w.req_pool.req_to_token.clone(),
            "k": w.kv.k_buffers[0].clone(),
            "v": w.kv.v_buffers[0].clone(),
        }

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        w = self.world
        w.req_pool.req_to_token.copy_(state["req_to_token"])
        w.kv.k_buffers[0].copy_(state["k"])
        w.kv.v_buffers[0].copy_(state["v"])

    def writable(self, inputs: Any) -> dict[str, list[int]]:
        slots = sorted(set(inputs.out_cache_loc.tolist()))
        return {"k": slots, "v": slots}

    def bystander(self) -> dict[str, int]:
        """The bystander's row and a slot of its first page, which live rows share."""
        first_page = self.world.slots[self._bystander][0]
        return {"request row": self._bystander, "KV slot": first_page}

    def limits(self) -> dict[str, int]:
        slots = self.world.kv.k_buffers[0].shape[0]
        return {
            "token": VOCAB,
            "request row": REQUESTS + 1,
            "KV slot": slots,
            "position": CONTEXT,
            "length": CONTEXT + 1,
        }


def test_shared_prefix_decode_is_clean_under_every_poison() -> None:
    case = SharedPrefixCase()
    counts = fuzz(lambda: case, "eager")
    assert counts.clean, "\n".join(counts.failures)
    live = range(1, SIZES[-1] + 1)
    assert counts.replays == len(live) * len(PATTERNS) * 2
    assert counts.live_rows == sum(live) * len(PATTERNS) * 2
    stats = case.world.cache.stats
    assert stats.hits == counts.live_rows  # every live request hit its prefix ...
    assert stats.misses == 2 * counts.replays  # ... and the two bystanders missed


@pytest.mark.parametrize(
    ("plant", "finding"),
    [
        ("shared_write", "expected a slot of a page only its request writes"),
        ("freed_indexed", "prefix cache inconsistent: page"),
    ],
)
def test_the_fuzz_finds_each_planted_sharing_bug(plant: str, finding: str) -> None:
    case = SharedPrefixCase(plant)
    sanitized = fuzz(lambda: case, "eager", paths=("sanitized",))
    assert sanitized.violations == sanitized.replays == SIZES[-1] * len(PATTERNS)
    assert all(finding in f for f in sanitized.failures), sanitized.failures
    lean = fuzz(lambda: case, "eager", paths=("lean",))
    assert lean.clean  # the lean path cannot see it: only the sanitizer does
