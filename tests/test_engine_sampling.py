"""Sampling through the engine: a request's tokens depend only on its seed,
its parameters and its logits, never on the runner, the captured sizes, the
other requests, their arrival, padding or overlap; temperature 0 is the
greedy engine's output exactly."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from graphrunner import FutureMap
from graphrunner.sampling import SamplingParams, request_seed
from graphrunner_ref import Engine, Request, create_decode_runner, default_model

CTX = 48


def _trace(
    sampling: Sequence[SamplingParams | None], arrive_every: int = 0, new: int = 10
) -> list[Request]:
    return [
        Request(i, tuple(range(3 + i, 8 + 2 * i)), new, i * arrive_every, sampling=s)
        for i, s in enumerate(sampling)
    ]


def _run(
    trace: list[Request],
    *,
    kind: str = "eager",
    sizes: Sequence[int] = (4,),
    seed: int = 0,
    overlap: bool = False,
    sampling: bool = True,
    **engine: Any,
) -> dict[int, list[int]]:
    bundle = default_model(max_requests=max(sizes), max_context_len=CTX)
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device) if overlap else None
    runner = create_decode_runner(
        bundle, kind, capture_sizes=list(sizes), sampling=sampling, future_map=future
    )
    runner.capture()
    free = (bundle.kv_alloc.available_size(), bundle.req_pool.available_size())
    out = Engine(bundle, runner, seed=seed, overlap=overlap, **engine).run(trace).outputs
    assert (bundle.kv_alloc.available_size(), bundle.req_pool.available_size()) == free
    return out


HOT = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.9, seed=77),
    SamplingParams(temperature=1.0, min_p=0.05),
]


def test_temperature_0_is_the_greedy_engine_bit_for_bit():
    greedy = _run(_trace([None] * 4), sampling=False)
    assert _run(_trace([SamplingParams()] * 2 + [None] * 2)) == greedy
    assert _run(_trace([SamplingParams(top_k=3, top_p=0.5, seed=5)] * 4)) == greedy


def test_same_seed_same_tokens_whatever_the_runner_sizes_arrivals_and_overlap():
    reference = _run(_trace(HOT))
    assert reference != _run(_trace([None] * 4), sampling=False)  # it does sample
    assert _run(_trace(HOT), sizes=(1, 2, 4, 8)) == reference  # other padded sizes
    assert _run(_trace(HOT, arrive_every=3)) == reference  # other batch company
    assert _run(_trace(HOT), overlap=True) == reference
    alone = {r.rid: _run([r])[r.rid] for r in _trace(HOT)}
    assert alone == reference


# The compiled sampled step equals eager per padded size in CI
# (tests/test_padded_sampling.py, tests/test_sampling_distribution.py).
def test_a_compiled_runner_samples_the_eager_runner_s_tokens():
    assert _run(_trace(HOT[:2]), kind="cpu") == _run(_trace(HOT[:2]))


def test_the_run_seed_and_the_request_seed_decide():
    a = _run(_trace(HOT), seed=1)
    b = _run(_trace(HOT), seed=2)
    assert a[2] == b[2]  # its own seed: the run seed does not touch it
    assert [a[i] for i in (0, 1, 3)] != [b[i] for i in (0, 1, 3)]
    # A request seeded with what the run seed would derive draws the same tokens.
    derived = [dataclasses.replace(HOT[0], seed=request_seed(1, 0))]
    assert _run(_trace(derived), seed=9)[0] == a[0]


def test_a_greedy_only_runner_refuses_a_sampling_request_by_name():
    with pytest.raises(ValueError, match=r"request 1: temperature 0.8 needs a runner that samples"):
        _run(_trace([None, HOT[1]]), sampling=False)
