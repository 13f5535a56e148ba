"""vLLM's request fields on ``graphrunner serve`` (the embedded model, its end
token set by ``--end-token``): ``ignore_eos`` runs an answer to exactly
``max_tokens`` past the end token, ``stop_token_ids`` end it with ``stop``
and the token as ``stop_reason``, ``min_tokens`` holds the end token back
(the tokens of the model alone with a torch reference that masks it,
tests/test_engine_min_tokens.py), and what the server cannot honour
(``min_tokens`` above ``max_tokens``, ``ignore_eos`` over several steps a
launch, a token outside the vocabulary) is a 400 naming the field. The
oracle is ``generate``'s greedy tokens without an end token."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_engine_min_tokens import alone

import graphrunner_ref.cli.main as cli
from graphrunner.sampling import SamplingParams
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.protocol import ChatMessage, ChatRequest, Limits, job_of
from serve_world import Server

PROMPT = [5, 17, 42, 9, 100, 3]
NEW = 16


def _greedy(tmp: Path) -> list[int]:
    """``generate``'s greedy tokens for PROMPT, no end token."""
    path = tmp / "prompt.txt"
    path.write_text(json.dumps(PROMPT) + "\n")
    argv = ["generate", "--prompts", str(path), "--json", "--runner", "eager", "--quiet"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main([*argv, "--max-new-tokens", str(NEW)]) == 0
    return list(json.loads(out.getvalue().splitlines()[0])["token_ids"])


@pytest.fixture(scope="module")
def greedy(tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    return _greedy(tmp_path_factory.mktemp("greedy"))


def _first_new(tokens: list[int], start: int) -> int:
    """The index of the first token from ``start`` on not seen before it."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def end_at(greedy: list[int]) -> int:
    return _first_new(greedy, 3)


@pytest.fixture(scope="module")
def server(greedy: list[int], end_at: int) -> Iterator[Server]:
    with Server("--runner", "eager", "--max-bs", "4", "--end-token", str(greedy[end_at])) as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


def _complete(server: Server, **fields: Any) -> tuple[int, Any]:
    status, _, body = server.post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": NEW, **fields}
    )
    return status, body


def test_the_end_token_ends_an_answer_unless_ignore_eos(
    server: Server, greedy: list[int], end_at: int
) -> None:
    status, body = _complete(server)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == greedy[: end_at + 1]
    assert choice["finish_reason"] == "stop"
    status, body = _complete(server, ignore_eos=True)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == greedy  # exactly max_tokens, past the end token
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == NEW


def test_stop_token_ids_end_an_answer_with_the_token_as_stop_reason(
    server: Server, greedy: list[int]
) -> None:
    at = _first_new(greedy, 1)
    status, body = _complete(server, ignore_eos=True, stop_token_ids=[greedy[at]])
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["token_ids"] == greedy[: at + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", greedy[at])
    events = list(
        server.stream(
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": NEW, "stream": True, "stop_token_ids": [greedy[at]]},
        )
    )
    streamed = [t for e in events[:-1] for t in e["choices"][0].get("token_ids") or []]
    assert streamed == greedy[: at + 1]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_holds_the_end_token_back_streamed_and_not(
    server: Server, greedy: list[int], end_at: int
) -> None:
    m = end_at + 4
    want = alone(PROMPT, NEW, {greedy[end_at]}, m)
    assert len(want) > m > end_at + 1  # longer than the answer the end token ends
    status, body = _complete(server, min_tokens=m)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == want
    events = list(
        server.stream("/v1/completions", {"prompt": PROMPT, "max_tokens": NEW, "stream": True,
                                          "min_tokens": m})
    )  # fmt: skip
    assert [t for e in events[:-1] for t in e["choices"][0].get("token_ids") or []] == want


class _Chat(TextCodec):
    """A stand-in tokenizer whose chat template renders any messages as 3 tokens."""

    def __init__(self) -> None:
        pass

    def chat_messages(self, messages: list[dict[str, str]], *, what: str, **_: Any) -> list[int]:
        return [2, 3, 4]


def test_chat_completions_take_min_tokens_too() -> None:
    limits = Limits(context=64, vocab_size=32, max_logprobs=0, sampling=SamplingParams(),
                    codec=_Chat())  # fmt: skip
    body = ChatRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=8)
    assert job_of(body.model_copy(update={"min_tokens": 5}), limits).min_tokens == 5
    checked = dataclasses.replace(limits, penalties=False)  # a --check server: refused by name
    with pytest.raises(APIError, match="min_tokens=5"):
        job_of(body.model_copy(update={"min_tokens": 5}), checked)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"min_tokens": NEW + 1}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2, "stop_token_ids": list(range(16))}, "stop_token_ids"),
        ({"stop_token_ids": [1 << 20]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_what_the_server_cannot_honour_is_refused_by_name(
    server: Server, fields: dict[str, Any], param: str
) -> None:
    status, body = _complete(server, **fields)
    assert status == 400, body
    assert param in body["error"]["message"]


def test_ignore_eos_is_refused_where_launches_end_rows_at_the_end_token(
    greedy: list[int], end_at: int
) -> None:
    end = str(greedy[end_at])
    args = ("--runner", "eager", "--max-bs", "2", "--end-token", end, "--steps-per-launch", "3")
    with Server(*args) as s:
        status, _, body = s.post(
            "/v1/completions", {"prompt": PROMPT, "max_tokens": NEW, "ignore_eos": True}
        )
        assert status == 400, body
        assert body["error"]["param"] == "ignore_eos"
        status, _, body = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": NEW})
        assert status == 200 and body["choices"][0]["token_ids"] == greedy[: end_at + 1]
        assert s.stop() == 0, "".join(s.log)
