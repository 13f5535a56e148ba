"""``Engine(overlap=True, steps_per_launch=N)``: launch i+1 prepared while
launch i runs, its input ids future references the launch stores on the
device. For every N the tokens equal the plain engine's at N = 1 exactly
(greedy and seeded sampling, with end tokens, requests finishing at every
position inside a launch, arrivals mid-run, page size 1 and > 1, the
sanitizer on), the pools are back to their start after every run, one read
back per launch."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from test_engine_multistep import CTX, _end_token, _reference, _trace
from test_engine_multistep import _run as _multistep_run
from test_engine_multistep_logprobs import _end_token as _logprobs_end
from test_engine_multistep_logprobs import _run as _logprobs_run
from test_engine_multistep_logprobs import _trace as _logprobs_trace

from graphrunner import FutureMap
from graphrunner_ref import Engine, create_decode_runner, default_model

#: The multi-step test's run, through the overlapped schedule.
_run = functools.partial(_multistep_run, overlap=True)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_overlap_emits_the_tokens_of_one_step_per_launch(n: int, page_size: int, sampled: bool):
    result = _run(_trace(sampled), n, sampled=sampled, page_size=page_size)
    assert result.outputs == _reference(sampled, None, page_size)
    assert result.finished == frozenset(range(10))
    s = result.stats
    assert s.syncs == s.launches > 0  # one read back per launch
    assert s.steps == n * s.launches
    first_tokens = len(result.outputs)  # each request's first comes from its prefill
    assert s.decode_tokens == sum(map(len, result.outputs.values())) - first_tokens


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("page_size", [1, 4])
def test_an_end_token_drops_rows_from_the_prepared_launch(n: int, page_size: int):
    end = _end_token()
    expected = _reference(False, end, page_size)
    assert any(out[-1] == end and len(out) > 1 for out in expected.values())
    assert _run(_trace(False), n, end_token=end, page_size=page_size).outputs == expected
    sampled = _run(_trace(True), n, sampled=True, end_token=end, page_size=page_size)
    assert sampled.outputs == _reference(True, end, page_size)


def test_the_launch_stores_each_rows_last_valid_token_in_the_future_map():
    end = _end_token()
    request = _trace(False)[9]  # its 5th token is the end token: step 4 of a launch of 8
    futures: list[FutureMap] = []
    out = _run([request], 8, end_token=end, sizes=(1,), future=futures).outputs[9]
    assert out[-1] == end and len(out) == 5
    stored = futures[0].tokens
    assert stored[stored != 0].tolist() == [end]  # tokens[row, count - 1], not the -1 after


def test_each_token_has_the_log_probabilities_of_one_step_per_launch():
    end = _logprobs_end()
    single = _logprobs_run(1, True, end)
    trace = _logprobs_trace(True)
    multi = _run(trace, 4, end_token=end, sizes=(4,), logprobs=3, seed=5)
    assert multi.outputs == single.outputs
    assert multi.logprobs == single.logprobs


def test_a_run_cut_by_max_steps_holds_a_prefix_and_frees_everything():
    for n in (2, 4):
        result = _run(_trace(False), n, page_size=4, max_steps=4 * n)
        assert result.stats.steps <= 4 * n
        full = _reference(False, None, 4)
        assert all(out == full[rid][: len(out)] for rid, out in result.outputs.items())
        assert result.finished < frozenset(range(10))


def test_a_compiled_runner_with_overlap_emits_the_eager_tokens():
    end = _end_token()
    result = _run(_trace(True), 4, kind="cpu", sampled=True, end_token=end, page_size=4)
    assert result.outputs == _reference(True, end, 4)


def test_overlap_needs_the_runner_built_with_a_future_map():
    bundle = default_model(max_requests=2, max_context_len=CTX)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2], steps_per_launch=4)
    with pytest.raises(ValueError, match="no future map.*future_map=FutureMap"):
        Engine(bundle, runner, steps_per_launch=4, overlap=True)


@pytest.mark.cuda
def test_on_cuda_the_one_wait_per_launch_is_the_only_sync(monkeypatch: pytest.MonkeyPatch):
    import torch

    import graphrunner_ref.engine.overlap_schedule as ov

    trace = _trace(False)
    bundle = default_model(max_requests=4, max_context_len=CTX, device="cuda")
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    runner = create_decode_runner(
        bundle, "cuda", capture_sizes=[2, 4], steps_per_launch=4, future_map=future
    )
    runner.capture()
    real_wait, waits = ov.HostCopy.wait, []

    def wait_allowed(self: Any) -> list[int]:
        waits.append(1)
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real_wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(ov.HostCopy, "wait", wait_allowed)
    engine = Engine(bundle, runner, overlap=True, steps_per_launch=4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = engine.run(trace)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result.stats.launches <= len(waits) <= result.stats.launches + len(trace)
    assert result.finished == frozenset(range(len(trace)))
