"""Log-probabilities through the engine: each generated token's (prefill's
first too) equals the log-softmax of an independent eager forward's logits,
with the top N sorted and the tokens those of the run without them."""

from __future__ import annotations

import pytest
import torch

from graphrunner import FutureMap
from graphrunner.sampling import SamplingParams
from graphrunner_ref import Engine, Request, create_decode_runner, default_model
from graphrunner_ref.engine.results import EngineResult
from graphrunner_ref.model import ModelBundle

CTX = 48
TRACE = [
    Request(0, (3, 4, 5, 6), 6),
    Request(1, (9, 8, 7), 5, 1, sampling=SamplingParams(temperature=1.0, seed=3)),
    Request(2, (1, 2), 7, 2, sampling=SamplingParams(temperature=0.7, top_k=5)),
]


def _run(
    kind: str = "eager", logprobs: int = 3, seed: int = 11, *, overlap: bool = False
) -> EngineResult:
    bundle = default_model(max_requests=4, max_context_len=CTX)
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device) if overlap else None
    runner = create_decode_runner(
        bundle, kind, capture_sizes=[1, 2, 4], sampling=True, logprobs=logprobs, future_map=future
    )
    runner.capture()
    engine = Engine(bundle, runner, seed=seed, logprobs=logprobs, overlap=overlap)
    return engine.run(TRACE)


def eager_last_logits(bundle: ModelBundle, tokens: list[int]) -> torch.Tensor:
    """The last logits ``[vocab]`` of a fresh prefill of ``tokens``."""
    row = bundle.req_pool.alloc(1)[0]
    slots = bundle.kv_alloc.alloc(len(tokens))
    try:
        ids = torch.tensor(tokens, dtype=torch.int64)
        return bundle.model.forward_extend(row, ids, torch.tensor(slots, dtype=torch.int64))
    finally:
        bundle.req_pool.free([row])
        bundle.kv_alloc.free(slots)


@pytest.mark.parametrize(
    "kind",
    ["eager", "cpu"],
)
def test_logprobs_are_the_eager_log_softmax_of_each_token(kind: str) -> None:
    result = _run(kind)
    reference = default_model(max_requests=4, max_context_len=CTX)  # same weights, own pools
    assert set(result.logprobs) == {0, 1, 2}
    for r in TRACE:
        tokens, entries = result.outputs[r.rid], result.logprobs[r.rid]
        assert len(entries) == len(tokens) == r.max_new_tokens
        for i, (token, (chosen, top)) in enumerate(zip(tokens, entries, strict=True)):
            lp = torch.log_softmax(eager_last_logits(reference, [*r.prompt, *tokens[:i]]), -1)
            assert chosen == pytest.approx(lp[token].item(), abs=1e-4)
            assert len(top) == 3
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            expected = torch.topk(lp, 3)
            assert [t for t, _ in top] == expected.indices.tolist()
            assert values == pytest.approx(expected.values.tolist(), abs=1e-4)
            if r.sampling is None:  # greedy: the chosen token is the most probable
                assert top[0][0] == token and top[0][1] == chosen


def test_overlap_scheduling_gives_the_same_tokens_and_logprobs() -> None:
    """Step N's log-probabilities are read after the host scheduled step N+1
    (requests retired, arrivals joined): each token keeps its own entry, in order."""
    plain, overlapped = _run(), _run(overlap=True)
    assert overlapped.outputs == plain.outputs
    assert overlapped.logprobs == plain.logprobs
    assert all(len(plain.logprobs[r.rid]) == r.max_new_tokens for r in TRACE)


def test_logprobs_leave_the_tokens_alone_and_are_absent_unless_asked() -> None:
    bundle = default_model(max_requests=4, max_context_len=CTX)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], sampling=True)
    runner.capture()
    plain = Engine(bundle, runner, seed=11).run(TRACE)
    assert plain.logprobs == {}
    assert _run(logprobs=3).outputs == plain.outputs
    assert _run(logprobs=1).outputs == plain.outputs


def test_logprobs_refused_without_the_runner_that_computes_them() -> None:
    bundle = default_model(max_requests=4, max_context_len=CTX)
    plain = create_decode_runner(bundle, "eager", capture_sizes=[4])
    with pytest.raises(ValueError, match="logprobs=2: the runner does not sample"):
        Engine(bundle, plain, logprobs=2)
    with pytest.raises(ValueError, match="logprobs=2 needs sampling=True"):
        create_decode_runner(bundle, "eager", capture_sizes=[4], logprobs=2)
    sampled = create_decode_runner(bundle, "eager", capture_sizes=[4], sampling=True)
    sampled.capture()
    free = bundle.kv_alloc.available_size()
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="expected an int in 0..20"):
            Engine(bundle, sampled, logprobs=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not return 2 top log-probabilities"):
        Engine(bundle, sampled, logprobs=2).run(TRACE)
    assert bundle.kv_alloc.available_size() == free  # freed on the error
