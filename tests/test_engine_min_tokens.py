"""vLLM's ``min_tokens`` through the engine: with an end token the greedy
answer would draw early, a request asking for ``m`` tokens gets at least
``m``, and its tokens equal a run of the model alone with a torch reference
that sets the end tokens' logits to ``-inf`` while it holds fewer than ``m``,
alone, in a padded batch, under overlap and several steps a launch, and
under the padding sanitizer; a runner without penalties refuses it by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_engine_penalties import run_penalized

from graphrunner.sampling import SamplingParams, sample
from graphrunner_ref import Request, default_model

CTX = 48
NEW = 12
PROMPTS = [(5, 17, 42, 9, 100, 3), (3, 4, 5, 6, 7, 8, 9), (11, 12, 13)]


def alone(
    prompt: Sequence[int],
    new: int,
    end: set[int],
    min_tokens: int,
    p: SamplingParams | None = None,
) -> list[int]:
    """The request alone through the model's own forward: each token the
    sampler's pick from its logits (plus ``p``'s logit bias, its one
    penalty here) with ``end`` at ``-inf`` while fewer than ``min_tokens``
    are out; it ends after an ``end`` token or ``new`` tokens."""
    p = p or SamplingParams()
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1, 0, 0)
    bundle = default_model(max_requests=1, max_context_len=CTX)
    row = bundle.req_pool.alloc(1)[0]
    ids = torch.tensor(list(prompt))
    out: list[int] = []
    t = torch.tensor
    with torch.no_grad():
        while len(out) < new and not (out and out[-1] in end):
            position = len(prompt) + len(out)
            slots = torch.tensor(bundle.kv_alloc.alloc(len(ids)))
            x = bundle.model.forward_extend(row, ids, slots, prefix_len=position - len(ids))
            x = x.to(torch.float32).view(1, -1).clone()
            for token, bias in dict(p.logit_bias).items():
                x[0, token] += bias
            if len(out) < min_tokens:
                x[0, sorted(end)] = float("-inf")
            seed = p.seed if p.seed is not None else 0
            token = sample(
                x, t([p.temperature]), t([p.top_k]), t([p.top_p]), t([p.min_p]), t([seed]),
                t([position]),
            )  # fmt: skip
            out.append(int(token[0]))
            ids = torch.tensor([out[-1]])
    return out


@pytest.fixture(scope="module")
def end_token() -> int:
    """A token the first prompt's greedy answer draws early (new at index >= 2)."""
    free = alone(PROMPTS[0], NEW, set(), 0)
    return next(free[i] for i in range(2, NEW) if free[i] not in free[:i])


def test_min_tokens_holds_the_end_token_back(end_token: int) -> None:
    free = run_penalized([Request(0, PROMPTS[0], NEW)], end_token)[0]
    assert free[-1] == end_token and len(free) < 6  # the greedy answer ends early
    got = run_penalized([Request(0, PROMPTS[0], NEW, min_tokens=6)], end_token)[0]
    assert len(got) >= 6
    assert end_token not in got[:6]
    assert got == alone(PROMPTS[0], NEW, {end_token}, 6)


def test_the_end_token_comes_right_after_the_hold(end_token: int) -> None:
    # biased to the top, the end token is drawn at once when held no longer
    eager = SamplingParams(logit_bias={end_token: 100.0})
    for m in (0, 1, 5):
        got = run_penalized([Request(0, PROMPTS[1], NEW, sampling=eager, min_tokens=m)], end_token)[
            0
        ]
        assert len(got) == m + 1 and got[-1] == end_token, (m, got)


def _trace(end: int) -> list[Request]:
    """Held requests beside free ones: a stop token held too, a sampled one,
    and one that ignores the end token (only its stop token held)."""
    return [
        Request(0, PROMPTS[0], NEW, min_tokens=7),
        Request(1, PROMPTS[1], NEW, stop_token_ids=(end + 1,), min_tokens=5),
        Request(2, PROMPTS[0], NEW),
        Request(3, PROMPTS[2], NEW, 1, SamplingParams(temperature=0.9, seed=4), min_tokens=9),
        Request(4, PROMPTS[0], 8, 2, ignore_eos=True, stop_token_ids=(end,), min_tokens=4),
        Request(5, PROMPTS[1], NEW, 3, SamplingParams(logit_bias={end: 100.0}), min_tokens=3),
    ]


def _alone_of(trace: list[Request], end: int) -> dict[int, list[int]]:
    out = {}
    for r in trace:
        ends = ({end} if not r.ignore_eos else set()) | set(r.stop_token_ids)
        out[r.rid] = alone(r.prompt, r.max_new_tokens, ends, r.min_tokens, r.sampling)
    return out


@pytest.mark.parametrize(
    "engine",
    [{}, {"overlap": True}, {"steps_per_launch": 3}, {"sanitize": True}],
    ids=["plain", "overlap", "3-steps", "sanitizer"],
)
def test_each_request_gets_the_references_tokens_in_a_padded_batch(
    end_token: int, engine: dict[str, Any]
) -> None:
    trace = _trace(end_token)
    if engine.get("steps_per_launch"):  # several steps a launch refuse ignore_eos
        trace = [r for r in trace if not r.ignore_eos]
    want = _alone_of(trace, end_token)
    assert run_penalized(trace, end_token, **engine) == want
    assert all(len(want[r.rid]) >= r.min_tokens for r in trace)


def test_a_runner_without_penalties_refuses_min_tokens_by_name(end_token: int) -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        run_penalized([Request(0, PROMPTS[0], NEW, min_tokens=3)], end_token, penalties=False)


def test_min_tokens_above_max_new_tokens_or_with_a_grammar_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="min_tokens=5"):
        Request(0, PROMPTS[0], 4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens=2 with a grammar"):
        Request(0, PROMPTS[0], 4, min_tokens=2, grammar=lambda: None)  # type: ignore[arg-type, return-value]
