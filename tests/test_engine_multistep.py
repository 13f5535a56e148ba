"""``Engine(steps_per_launch=N)``: for every N the tokens equal N = 1 exactly
(greedy and seeded sampling, with end tokens, requests finishing at every
position inside a launch, page size 1 and > 1, the sanitizer on), the pools
are back to their start after every run, one read back per launch."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest

from graphrunner import FutureMap
from graphrunner.sampling import SamplingParams
from graphrunner_ref import Engine, Request, create_decode_runner, default_model
from graphrunner_ref.engine.multistep_overlap import MultiStepOverlapSchedule
from graphrunner_ref.engine.results import EngineResult

CTX = 64
HOT = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20),
    None,
    SamplingParams(temperature=1.3, top_p=0.9, seed=77),
    SamplingParams(temperature=1.0, min_p=0.05),
]


def _trace(sampled: bool, count: int = 10) -> list[Request]:
    """Budgets 1..count (finishing at every position of a launch of up to 8),
    arrivals staggered so rows join and leave between launches."""
    return [
        Request(
            i,
            tuple(range(3 + i, 7 + 2 * i)),
            1 + i,
            (i * 2) // 3,
            sampling=HOT[i % len(HOT)] if sampled else None,
        )
        for i in range(count)
    ]


def _run(
    trace: Sequence[Request],
    n: int,
    *,
    kind: str = "eager",
    sampled: bool = False,
    end_token: int | None = None,
    page_size: int = 1,
    sizes: Sequence[int] = (2, 4),
    overlap: bool = False,
    future: list[FutureMap] | None = None,
    logprobs: int = 0,
    seed: int = 3,
    **run: Any,
) -> EngineResult:
    """``trace`` served at N = ``n`` with the sanitizer on (with ``overlap``,
    through the overlapped multi-step schedule, its future map appended to
    ``future``); every pool back to its start afterwards."""
    bundle = default_model(max_requests=max(sizes), max_context_len=CTX, page_size=page_size)
    futures = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device) if overlap else None
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=list(sizes),
        sampling=sampled or bool(logprobs),
        logprobs=logprobs,
        steps_per_launch=n,
        end_token=end_token,
        future_map=futures,
        check_padding=True,
    )
    runner.capture()
    free = (bundle.kv_alloc.available_size(), bundle.req_pool.available_size())
    engine = Engine(
        bundle,
        runner,
        end_token=end_token,
        steps_per_launch=n,
        overlap=overlap,
        seed=seed,
        logprobs=logprobs,
    )
    assert isinstance(engine.schedule, MultiStepOverlapSchedule) == overlap
    result = engine.run(trace, **run)
    assert (bundle.kv_alloc.available_size(), bundle.req_pool.available_size()) == free
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked > 0
    if future is not None and futures is not None:
        future.append(futures)
    return result


@functools.cache
def _reference(sampled: bool, end_token: int | None, page_size: int) -> dict[int, list[int]]:
    return _run(
        _trace(sampled), 1, sampled=sampled, end_token=end_token, page_size=page_size
    ).outputs


def _end_token() -> int:
    """A token the greedy requests emit inside their outputs (some early, some late)."""
    outputs = _reference(False, None, 1)
    return outputs[9][4]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_n_emits_the_tokens_of_one_step_per_launch(n: int, page_size: int, sampled: bool):
    result = _run(_trace(sampled), n, sampled=sampled, page_size=page_size)
    assert result.outputs == _reference(sampled, None, page_size)
    assert result.finished == frozenset(range(10))
    assert result.stats.syncs == result.stats.launches  # one read back per launch


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("page_size", [1, 4])
def test_an_end_token_stops_rows_inside_a_launch_as_one_step_does(n: int, page_size: int):
    end = _end_token()
    expected = _reference(False, end, page_size)
    cut = [rid for rid, out in expected.items() if out[-1] == end and len(out) > 1]
    assert cut  # the end token does stop some requests after their first token
    assert _run(_trace(False), n, end_token=end, page_size=page_size).outputs == expected
    sampled = _run(_trace(True), n, sampled=True, end_token=end, page_size=page_size)
    assert sampled.outputs == _reference(True, end, page_size)


def test_a_compiled_runner_emits_the_eager_tokens():
    result = _run(_trace(True), 4, kind="cpu", sampled=True, page_size=4)
    assert result.outputs == _reference(True, None, 4)


def test_stats_count_launches_and_syncs_per_token():
    one, four = (_run(_trace(False), n, sizes=(4,)).stats for n in (1, 4))
    assert one.decode_tokens == four.decode_tokens
    assert one.launches == one.syncs == one.steps
    assert four.launches == four.syncs < one.launches
    assert four.steps == 4 * four.launches
    assert four.launches_per_token < one.launches_per_token
    assert 0 < four.syncs_per_token < one.syncs_per_token


@pytest.mark.parametrize("n", [1, 4])
def test_stats_count_row_steps_and_the_sanitized_launches(n: int):
    """One graph of 4 rows: every launch computes 4 x N row steps; those no
    request took (padded rows, and a row's steps after it stopped inside a
    launch) are the padded ones, and the sanitizer checked every launch."""
    s = _run(_trace(False), n, sizes=(4,)).stats
    assert s.live_rows == s.decode_tokens
    assert s.live_rows + s.padded_rows == s.launches * 4 * n
    assert s.sanitized_replays == s.launches
    assert s.sanitizer_seconds > 0


def test_the_options_it_does_not_support_are_refused_by_name():
    bundle = default_model(max_requests=2, max_context_len=CTX)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2], steps_per_launch=4)
    plain = create_decode_runner(bundle, "eager", capture_sizes=[2])
    with pytest.raises(ValueError, match="end_token=5.*end_token=5"):
        Engine(bundle, runner, steps_per_launch=4, end_token=5)
    with pytest.raises(ValueError, match="steps_per_launch=2.*steps_per_launch=2"):
        Engine(bundle, runner, steps_per_launch=2)
    with pytest.raises(ValueError, match="steps_per_launch=4.*steps_per_launch=4"):
        Engine(bundle, plain, steps_per_launch=4)
    bad: list[Any] = [0, 9, True, "4"]
    for value in bad:
        with pytest.raises(ValueError, match="steps_per_launch"):
            Engine(bundle, plain, steps_per_launch=value)
        with pytest.raises(ValueError, match="steps_per_launch"):
            create_decode_runner(bundle, "eager", steps_per_launch=value)
    with pytest.raises(ValueError, match="logprobs=2 needs sampling=True"):
        create_decode_runner(bundle, "eager", steps_per_launch=4, logprobs=2)


def test_the_runner_s_phase_carries_its_steps_and_end_token():
    """What the engine checks its options against is the runner's phase, a
    value: no registry beside it."""
    bundle = default_model(max_requests=2, max_context_len=CTX)
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=[2], steps_per_launch=4, end_token=5
    )
    assert (runner.phase.steps, runner.phase.end_token) == (4, 5)
    Engine(bundle, runner, steps_per_launch=4, end_token=5)  # agrees: accepted
    plain = create_decode_runner(bundle, "eager", capture_sizes=[2])
    assert (plain.phase.steps, plain.phase.end_token) == (1, None)
