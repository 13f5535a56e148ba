"""Penalties and logit bias through the engine: each request's tokens equal a
run of the model alone on that request with the torch reference of vLLM's
formulas (tests/test_penalties.py) applied to its logits, whatever the
other requests, padding, overlap or steps per launch; a runner without
penalties refuses such a request by name; under the padding sanitizer the
step writes only its live rows' counts (a planted write at row 0 is seen)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_penalties import expected_token

from graphrunner import FutureMap, PaddingViolation
from graphrunner.sampling import SamplingParams, TokenCounts
from graphrunner_ref import Engine, Request, create_decode_runner, default_model

CTX = 48
NEW = 9

PARAMS = [
    SamplingParams(repetition_penalty=1.9),
    SamplingParams(),
    SamplingParams(frequency_penalty=2.0, presence_penalty=1.0),
    SamplingParams(temperature=0.9, seed=5, repetition_penalty=0.5, presence_penalty=-2.0),
    SamplingParams(logit_bias={7: 100.0, 8: 60.0, 9: -100.0}, frequency_penalty=1.0),
]


def _trace(params: Sequence[SamplingParams], arrive_every: int = 1) -> list[Request]:
    return [
        Request(i, tuple(range(3 + i, 9 + 2 * i)), NEW, i * arrive_every, sampling=p)
        for i, p in enumerate(params)
    ]


def run_penalized(
    trace: list[Request],
    end: int | None = None,
    *,
    penalties: bool = True,
    sanitize: bool = False,
    **engine: Any,
) -> dict[int, list[int]]:
    """``trace``'s outputs through an engine over the embedded model whose
    eager runner samples with (or without) ``penalties``, ending rows at
    ``end``, with the padding sanitizer when ``sanitize``; ``engine``: the
    engine's options (``overlap``, ``steps_per_launch``, ...)."""
    bundle = default_model(max_requests=4, max_context_len=CTX)
    overlap = engine.get("overlap", False)
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device) if overlap else None
    steps = engine.get("steps_per_launch", 1)
    runner = create_decode_runner(
        bundle,
        "eager",
        capture_sizes=[4],
        sampling=True,
        penalties=penalties,
        future_map=future,
        steps_per_launch=steps,
        end_token=end if steps > 1 else None,
        check_padding=sanitize,
    )
    runner.capture()
    return Engine(bundle, runner, end_token=end, **engine).run(trace).outputs


def alone_tokens(request: Request) -> list[int]:
    """The request run alone through the model's own forward, each token the
    reference's pick from the model's logits."""
    bundle = default_model(max_requests=1, max_context_len=CTX)
    p = request.sampling or SamplingParams()
    seed = p.seed if p.seed is not None else 0
    row = bundle.req_pool.alloc(1)[0]
    ids = torch.tensor(request.prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(request.max_new_tokens):
            position = len(request.prompt) + len(out)
            slots = torch.tensor(bundle.kv_alloc.alloc(len(ids)))
            logits = bundle.model.forward_extend(row, ids, slots, prefix_len=position - len(ids))
            out.append(expected_token(logits, request.prompt, out, p, seed, position))
            ids = torch.tensor([out[-1]])
    return out


@pytest.fixture(scope="module")
def alone() -> dict[int, list[int]]:
    return {r.rid: alone_tokens(r) for r in _trace(PARAMS)}


def test_each_request_gets_the_references_tokens_in_a_padded_batch(alone) -> None:
    got = run_penalized(_trace(PARAMS))
    assert got == alone
    # the penalties bite: a neutral run of the same prompts picks other tokens
    plain = run_penalized(
        _trace([SamplingParams(temperature=p.temperature, seed=p.seed) for p in PARAMS])
    )
    assert sum(plain[i] != alone[i] for i in alone) >= 3


@pytest.mark.parametrize("engine", [{"overlap": True}, {"steps_per_launch": 3}])
def test_overlap_and_several_steps_a_launch_count_as_one_step_does(alone, engine) -> None:
    assert run_penalized(_trace(PARAMS, arrive_every=0), **engine) == alone


def test_neutral_rows_match_the_runner_without_penalties() -> None:
    neutral = [SamplingParams(), SamplingParams(temperature=1.0, seed=3)]
    assert run_penalized(_trace(neutral)) == run_penalized(_trace(neutral), penalties=False)


def test_a_row_passed_between_penalized_and_plain_requests_keeps_each_ones_tokens() -> None:
    """One request row, reused: a plain greedy request's first token is the
    argmax, its row's counts (the penalized request's before it) left as
    they were, and the penalized request after it starts its counts afresh."""
    prompt = tuple(range(3, 11))
    params = [SamplingParams(repetition_penalty=1.9, frequency_penalty=2.0), None]
    trace = [Request(i, prompt, NEW, i, sampling=params[i % 2]) for i in range(3)]
    bundle = default_model(max_requests=1, max_context_len=CTX)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1], sampling=True, penalties=True)
    runner.capture()
    got = Engine(bundle, runner).run(trace).outputs
    assert got == {r.rid: alone_tokens(r) for r in trace}
    assert got[0] != got[1]  # the penalty bites: a stale count would show


def test_a_runner_without_penalties_refuses_them_by_name() -> None:
    with pytest.raises(ValueError, match="repetition_penalty"):
        run_penalized(_trace(PARAMS[:1]), penalties=False)


def test_a_logit_bias_outside_the_vocabulary_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        run_penalized(_trace([SamplingParams(logit_bias={10_000: 1.0})]))


def _sanitized(trace: list[Request]) -> dict[int, list[int]]:
    bundle = default_model(max_requests=4, max_context_len=CTX)
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=[4], sampling=True, penalties=True, check_padding=True
    )
    runner.capture()
    return Engine(bundle, runner).run(trace).outputs


def test_the_sanitizer_passes_the_penalties_step(alone) -> None:
    assert _sanitized(_trace(PARAMS, arrive_every=0)) == alone


def test_the_sanitizer_sees_a_padded_row_count_at_row_zero(monkeypatch) -> None:
    def unmasked(self: TokenCounts, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        self.counts.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.int32), True)

    monkeypatch.setattr(TokenCounts, "record", unmasked)
    with pytest.raises(PaddingViolation, match="token_counts"):
        _sanitized(_trace(PARAMS[:2]))
