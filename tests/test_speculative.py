"""Chain speculative decoding is lossless: for many prompts, staggered
arrivals, K in {1, 2, 4} and every draft, the greedy output equals plain
greedy decoding token for token (fp64, so argmax ties stay out); the self
draft is always fully accepted, the wrong one never; pools end as they began."""

from __future__ import annotations

import functools

import pytest
import torch

from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.spec_factory import speculative_engine
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import ModelBundle, default_model

SIZES = [1, 2, 4]


def _trace() -> list[Request]:
    gen = torch.Generator().manual_seed(3)
    lens = [3, 9, 1, 14, 6, 2, 11, 5]
    arrivals = [0, 0, 1, 1, 2, 4, 5, 5]  # staggered, several at once
    return [
        Request(i, tuple(torch.randint(0, 256, (n,), generator=gen).tolist()), 10, arrival)
        for i, (n, arrival) in enumerate(zip(lens, arrivals, strict=True))
    ]


def _bundle() -> ModelBundle:
    return default_model(max_requests=4, max_context_len=40, dtype=torch.float64)


@functools.cache
def _plain_greedy() -> dict[int, list[int]]:
    bundle = _bundle()
    runner = create_decode_runner(bundle, "eager", capture_sizes=SIZES)
    runner.capture()
    return Engine(bundle, runner).run(_trace()).outputs


CASES = [
    (method, draft, k)
    for k in (1, 2, 4)
    for method, draft in (("mtp", "random"), ("eagle", "random"), ("mtp", "self"), ("mtp", "wrong"))
]


@pytest.mark.parametrize(("method", "draft", "k"), CASES)
def test_speculative_output_equals_plain_greedy(method: str, draft: str, k: int):
    bundle = _bundle()
    free = (bundle.kv_alloc.available_size(), bundle.req_pool.available_size())
    engine = speculative_engine(
        bundle, "eager", method=method, draft=draft, k=k, capture_sizes=SIZES, check_padding=True
    )
    result = engine.run(_trace())
    assert result.outputs == _plain_greedy()
    assert result.finished == set(result.outputs)
    stats = result.stats
    assert stats.proposed == k * stats.request_rounds
    if draft == "self":
        assert stats.accepted == stats.proposed  # the target agrees with itself
        assert stats.tokens_per_step > 1
    if draft == "wrong":
        assert stats.accepted == 0
    assert (bundle.kv_alloc.available_size(), bundle.req_pool.available_size()) == free
    assert max(stats.batch_sizes) > 1  # rounds of several requests, most of them padded


# Each compiles a verify and a drafter graph per size (a minute cold).
@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_compiled_speculative_runners_are_lossless_too(method: str):
    bundle = _bundle()
    engine = speculative_engine(bundle, "cpu", method=method, k=2, capture_sizes=[2, 4])
    assert engine.run(_trace()).outputs == _plain_greedy()


def test_an_end_token_finishes_inside_a_round():
    plain = _plain_greedy()
    end = plain[1][3]  # some token the second request emits
    bundle = _bundle()
    runner = create_decode_runner(bundle, "eager", capture_sizes=SIZES)
    runner.capture()
    expected = Engine(bundle, runner, end_token=end).run(_trace()).outputs
    spec = speculative_engine(
        _bundle(), "eager", draft="self", k=4, capture_sizes=SIZES, end_token=end
    )
    assert spec.run(_trace()).outputs == expected


def test_bad_arguments_are_named():
    bundle = _bundle()
    with pytest.raises(ValueError, match="method='medusa'; expected one of"):
        speculative_engine(bundle, "eager", method="medusa")
    with pytest.raises(ValueError, match="draft='oracle'; expected one of"):
        speculative_engine(bundle, "eager", draft="oracle")
    with pytest.raises(ValueError, match="k=0; expected an int >= 1"):
        speculative_engine(bundle, "eager", k=0)
    paged = default_model(max_requests=2, max_context_len=40, page_size=4)
    with pytest.raises(ValueError, match="page_size=4; expected 1"):
        speculative_engine(paged, "eager", capture_sizes=[1, 2])
    engine = speculative_engine(bundle, "eager", k=4, capture_sizes=[1, 2])
    too_long = [Request(0, tuple(range(20)), max_new_tokens=20)]
    with pytest.raises(ValueError, match="needs a context of 44; expected <= max_context_len 40"):
        engine.run(too_long)
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size
