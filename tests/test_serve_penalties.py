"""Penalties and logit bias on ``graphrunner serve`` (the embedded model):
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty`` and
``logit_bias`` over HTTP give the tokens of the model run alone with the
torch reference of vLLM's formulas (tests/test_penalties.py), alone and
served together with a neutral request; a value outside vLLM's ranges, or a
``logit_bias`` key that is not a token of the vocabulary, is a 400 naming
the field."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from test_engine_penalties import alone_tokens

from graphrunner.sampling import SamplingParams
from graphrunner_ref import Request
from serve_world import Server

PROMPT = (5, 17, 42, 9, 100, 3)
NEW = 10

#: Request fields, and the same as SamplingParams.
CASES: list[tuple[dict[str, Any], SamplingParams]] = [
    (
        {"repetition_penalty": 1.9, "logit_bias": {"7": 100, "9": -100}},
        SamplingParams(repetition_penalty=1.9, logit_bias={7: 100.0, 9: -100.0}),
    ),
    ({}, SamplingParams()),
    (
        {"temperature": 0.9, "seed": 5, "frequency_penalty": 2, "presence_penalty": -1.5},
        SamplingParams(temperature=0.9, seed=5, frequency_penalty=2.0, presence_penalty=-1.5),
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--runner", "eager", "--max-bs", "4") as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


def _complete(server: Server, fields: dict[str, Any]) -> tuple[int, Any]:
    body = {"prompt": list(PROMPT), "max_tokens": NEW, "temperature": 0, **fields}
    status, _, answer = server.post("/v1/completions", body)
    return status, answer


def _want(params: SamplingParams) -> list[int]:
    return alone_tokens(Request(0, PROMPT, NEW, 0, sampling=params))


def test_a_penalized_request_gets_the_references_tokens(server: Server) -> None:
    fields, params = CASES[0]
    status, body = _complete(server, fields)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == _want(params)
    assert _want(params) != _want(SamplingParams())  # the penalties bite


def test_requests_served_together_each_get_their_own_tokens(server: Server) -> None:
    with ThreadPoolExecutor(len(CASES)) as pool:
        answers = list(pool.map(lambda c: _complete(server, c[0]), CASES))
    for (_, params), (status, body) in zip(CASES, answers, strict=True):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == _want(params), params


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"256": 1}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(65)}}, "logit_bias"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(
    server: Server, fields: dict[str, Any], param: str
) -> None:
    status, body = _complete(server, fields)
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert param in body["error"]["message"]
