"""``Engine(logprobs=n, steps_per_launch=N)``: every token's log-probability
entry (prefill's first too) equals N = 1's exactly, greedy and sampled, with
an end token stopping rows inside a launch; the launch returns each step's
``logprob`` ``[bs, N]`` and top ``[bs, N, n]``."""

from __future__ import annotations

import functools

import pytest

from graphrunner.sampling import SamplingParams
from graphrunner_ref import Engine, Request, create_decode_runner, default_model
from graphrunner_ref.engine.results import EngineResult

CTX = 64
HOT = [SamplingParams(temperature=1.0), None, SamplingParams(temperature=0.7, top_k=5, seed=9)]


def _trace(sampled: bool) -> list[Request]:
    """Budgets 1..9 (finishing at every position of a launch), staggered arrivals."""
    return [
        Request(
            i,
            tuple(range(2 + i, 6 + 2 * i)),
            1 + i,
            i // 2,
            sampling=HOT[i % 3] if sampled else None,
        )
        for i in range(9)
    ]


@functools.cache
def _run(
    n: int, sampled: bool, end_token: int | None, logprobs: int = 3, kind: str = "eager"
) -> EngineResult:
    bundle = default_model(max_requests=4, max_context_len=CTX)
    runner = create_decode_runner(
        bundle,
        kind,
        capture_sizes=[4],  # one padded size: each row computed in the same shape as N = 1's
        sampling=True,
        logprobs=logprobs,
        steps_per_launch=n,
        end_token=end_token if n > 1 else None,
        check_padding=True,
    )
    runner.capture()
    free = bundle.kv_alloc.available_size()
    engine = Engine(
        bundle, runner, end_token=end_token, seed=5, logprobs=logprobs, steps_per_launch=n
    )
    result = engine.run(_trace(sampled))
    assert bundle.kv_alloc.available_size() == free
    return result


def _end_token() -> int:
    return _run(1, False, None).outputs[8][3]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_each_token_has_the_entry_of_one_step_per_launch(n: int, sampled: bool) -> None:
    single, multi = _run(1, sampled, None), _run(n, sampled, None)
    assert multi.outputs == single.outputs
    assert multi.logprobs == single.logprobs
    for r in _trace(sampled):
        assert len(multi.logprobs[r.rid]) == len(multi.outputs[r.rid]) == r.max_new_tokens
    assert multi.stats.syncs == multi.stats.launches  # the tokens' read stays one per launch


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_rows_stopping_at_the_end_token_keep_their_entries(n: int, sampled: bool) -> None:
    end = _end_token()
    single, multi = _run(1, sampled, end), _run(n, sampled, end)
    assert any(out[-1] == end and len(out) > 1 for out in single.outputs.values())
    assert multi.outputs == single.outputs
    assert multi.logprobs == single.logprobs
    assert all(len(multi.logprobs[rid]) == len(out) for rid, out in multi.outputs.items())


def test_a_compiled_launch_has_the_entries_of_one_compiled_step() -> None:
    single, multi = _run(1, True, None, kind="cpu"), _run(2, True, None, kind="cpu")
    assert multi.outputs == single.outputs
    assert multi.logprobs == single.logprobs


def test_a_runner_without_the_top_n_is_refused_when_read() -> None:
    bundle = default_model(max_requests=4, max_context_len=CTX)
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=[4], sampling=True, logprobs=2, steps_per_launch=2
    )
    runner.capture()
    free = bundle.kv_alloc.available_size()
    with pytest.raises(ValueError, match="does not return 3 top log-probabilities"):
        Engine(bundle, runner, logprobs=3, steps_per_launch=2).run(_trace(False))
    assert bundle.kv_alloc.available_size() == free
