"""The engine loop on the embedded default model, through the eager runner
(same buffers and padding as the graph runners, no compile time)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from graphrunner.engine import Engine, EngineResult, create_model_runner
from graphrunner.model import ModelBundle, default_model
from graphrunner.trace import Request, requests_from_prompts, synthetic_trace

MAX_BS = 4


def _engine(
    *, check: bool = False, end_token: int | None = None, max_requests: int = MAX_BS
) -> Engine:
    bundle = default_model(max_requests=max_requests)
    runner = create_model_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    return Engine(bundle, runner, check=check, end_token=end_token)


def _trace(n: int = 10, seed: int = 3) -> list[Request]:
    return synthetic_trace(
        num_requests=n,
        vocab_size=256,
        max_context_len=256,
        seed=seed,
        prompt_len=(1, 20),
        new_tokens=(1, 12),
        mean_gap=1.0,
    )


def _solo_greedy(bundle: ModelBundle, req: Request) -> list[int]:
    """The model alone, one request, no runner, no batching."""
    from graphrunner.batch import DecodeBatch

    index = bundle.req_pool.alloc(1)[0]
    slots = bundle.kv_alloc.alloc(len(req.prompt))
    tokens = [
        int(
            bundle.model.forward_extend(
                index, torch.tensor(req.prompt), torch.tensor(slots)
            ).argmax()
        )
    ]
    batch = DecodeBatch.from_requests(
        [index],
        [len(req.prompt)],
        torch.tensor(tokens),
        device="cpu",
        max_context_len=bundle.max_context_len,
    )
    while len(tokens) < req.max_new_tokens:
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc, torch.tensor(tokens[-1:]))
        with torch.no_grad():
            tokens.append(int(bundle.model.forward_decode(batch).argmax()))
    return tokens


def test_continuous_batching_equals_each_request_alone() -> None:
    engine = _engine(check=True)
    trace = _trace()
    result = engine.run(trace)
    assert result.finished == {r.rid for r in trace}
    assert result.stats.mismatches == 0 and result.stats.checked_steps == result.stats.steps
    assert max(result.stats.batch_sizes) == MAX_BS and result.stats.padded_rows > 0
    solo = default_model(max_requests=1)
    for req in trace:
        assert len(result.outputs[req.rid]) == req.max_new_tokens
        assert result.outputs[req.rid] == _solo_greedy(solo, req)
        solo.req_pool.clear()
        solo.kv_alloc.clear()


def test_pools_are_free_after_a_run_and_after_a_cut_run() -> None:
    engine = _engine()
    b = engine.bundle
    full_kv, full_reqs = b.kv_alloc.available_size(), b.req_pool.available_size()
    engine.run(_trace())
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == (full_kv, full_reqs)
    cut = engine.run(_trace(seed=4), max_steps=3)
    assert cut.stats.steps == 3 and len(cut.finished) < 10
    assert (b.kv_alloc.available_size(), b.req_pool.available_size()) == (full_kv, full_reqs)


def test_end_token_finishes_a_request_and_is_kept() -> None:
    trace = requests_from_prompts(
        [[1, 2, 3], [7], [40, 41, 42, 43]], max_new_tokens=10, arrive_every=1
    )
    baseline = _engine().run(trace).outputs
    end = baseline[0][3]
    result = _engine(end_token=end).run(trace)
    assert result.finished == {0, 1, 2}
    for rid, tokens in baseline.items():
        cut = tokens.index(end) + 1 if end in tokens else len(tokens)
        assert result.outputs[rid] == tokens[:cut]


def test_admission_waits_for_rows_and_kv_room() -> None:
    # Room for one full-length request only: the others must wait their turn.
    bundle = default_model(max_requests=1)
    runner = create_model_runner(bundle, "eager", capture_sizes=[1, 2])
    runner.capture()
    trace = requests_from_prompts([[1] * 10, [2] * 10, [3] * 10], max_new_tokens=5)
    result = Engine(bundle, runner).run(trace)
    assert result.finished == {0, 1, 2} and result.stats.batch_sizes == {1: 12}


@pytest.mark.parametrize(
    "request_, match",
    [
        (Request(0, (1, 256), 4), "token id 256 outside the vocabulary"),
        (Request(0, (1,) * 250, 8), "257 tokens"),
    ],
)
def test_invalid_requests_fail_before_any_work(request_: Request, match: str) -> None:
    engine = _engine()
    with pytest.raises(ValueError, match=match):
        engine.run([Request(1, (5,), 3), request_])
    assert engine.runner.stats.replays == 0


class StrayWriter:
    """A runner that, after each replay, writes into a live KV slot it does not own."""

    def __init__(self, inner: Any, bundle: ModelBundle) -> None:
        self.inner, self.bundle = inner, bundle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def replay(self, batch: Any) -> Any:
        out = self.inner.replay(batch)
        first_slot = int(self.bundle.req_pool.req_to_token[batch.req_pool_indices_cpu[0], 0])
        self.bundle.kv_cache.k_buffers[0][first_slot] += 1.0
        return out


def test_check_catches_a_runner_that_corrupts_live_kv() -> None:
    engine = _engine(check=True)
    engine.runner = StrayWriter(engine.runner, engine.bundle)  # type: ignore[assignment]
    result: EngineResult = engine.run(_trace(n=4))
    assert result.stats.mismatches == result.stats.steps > 0
    assert result.stats.max_kv_diff >= 1.0
