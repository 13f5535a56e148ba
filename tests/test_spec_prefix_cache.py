"""Speculative decoding through the prefix cache (issue 72): a prompt whose
prefix an earlier prompt left cached is prefilled from its first uncached
token, and every output equals the run without the cache token for token
(fp64: argmax ties stay out), greedy and seeded sampled alike; the pool ends
with every page free or cached; an EAGLE head, whose draft KV keys on the
next token too, is refused by name."""

from __future__ import annotations

import pytest
import torch

from graphrunner.sampling import SamplingParams
from graphrunner_ref.engine.spec_factory import caches_prefix, speculative_engine
from graphrunner_ref.engine.spec_stats import SpeculativeResult
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import default_model

SIZES = [1, 2, 4]
PREFIX = 13  # shared by every prompt; suffixes of 1..5 tokens


def _trace(sampling: SamplingParams | None = None) -> list[Request]:
    """Prompts on one prefix, two arriving at once, the rest one after
    another, one of them the prefix and a token only: the engine prefills
    one prompt at a time, so every prompt after the first finds the prefix."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, 256, (PREFIX,), generator=gen).tolist()
    suffixes = [3, 2, 5, 1, 4, 2]
    arrivals = [0, 0, 6, 12, 14, 30]
    return [
        Request(
            i,
            tuple(prefix + torch.randint(1, 256, (n,), generator=gen).tolist()),
            8,
            arrival,
            sampling=sampling,
        )
        for i, (n, arrival) in enumerate(zip(suffixes, arrivals, strict=True))
    ]


def _run(
    method: str, draft: str, cached: bool, trace: list[Request], **options: object
) -> SpeculativeResult:
    bundle = default_model(max_requests=4, max_context_len=48, dtype=torch.float64)
    options |= {"k": 2, "capture_sizes": SIZES, "prefix_caching": cached}
    engine = speculative_engine(bundle, "eager", method=method, draft=draft, **options)
    result = engine.run(trace)
    alloc = bundle.kv_alloc
    assert alloc.allocated() == frozenset()  # every page free or cached, none held
    assert alloc.inconsistencies() == []
    assert bundle.req_pool.available_size() == 4
    return result


@pytest.mark.parametrize(
    ("method", "draft"), [("mtp", "random"), ("mtp", "self"), ("mtp", "wrong")]
)
def test_cached_prefixes_change_no_token(method: str, draft: str) -> None:
    trace = _trace()
    cached = _run(method, draft, True, trace, check_padding=True)
    plain = _run(method, draft, False, trace)
    assert cached.outputs == plain.outputs
    s = cached.stats
    hits = len(trace) - 1  # every prompt after the first: the prefix's 13 tokens
    assert s.cached_tokens == hits * PREFIX, s
    assert s.prefill_tokens == plain.stats.prefill_tokens - hits * PREFIX
    assert s.prefix_hit_rate == pytest.approx(s.cached_tokens / sum(len(r.prompt) for r in trace))
    assert plain.stats.cached_tokens == 0


def test_a_seeded_sampled_request_draws_the_same_tokens_cached_or_not() -> None:
    trace = _trace(SamplingParams(temperature=0.8, top_k=20, seed=11))
    cached = _run("mtp", "random", True, trace)
    assert cached.outputs == _run("mtp", "random", False, trace).outputs
    assert cached.stats.cached_tokens > 0


def test_an_eagle_head_is_refused_by_name_and_said_so() -> None:
    assert not caches_prefix("eagle", "random")
    assert caches_prefix("mtp", "random") and caches_prefix("eagle", "self")
    bundle = default_model(max_requests=2, max_context_len=32)
    with pytest.raises(ValueError, match="EagleDrafter.*next token.*--no-prefix-caching"):
        speculative_engine(
            bundle, "eager", method="eagle", k=1, capture_sizes=[1], prefix_caching=True
        )
