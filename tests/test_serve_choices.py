"""``n`` > 1 (parallel sampling) through ``graphrunner serve``: ``n`` choices
of one prompt, each the tokens of the same request sent alone with seed
``seed + i``; reproducible; streamed choices carry their ``index`` and join
to the whole answer's; the prompt is prefilled once (the other choices find
it in the prefix cache) and counted once in ``usage``."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, cast

import pytest

from serve_world import Server

PROMPT = [5, 17, 42, 9, 77, 3, 120, 64, 8, 250, 31, 99]
NEW = 12


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with Server("--model", "embedded", "--runner", "eager", "--max-bs", "4") as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


def _complete(server: Server, **fields: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 1.0, **fields}
    status, _, answer = server.post("/v1/completions", body)
    assert status == 200, answer
    return answer


def _computed_prompt_tokens(server: Server) -> float:
    m = server.idle_metrics()
    return m["graphrunner_prefix_cache_queries_total"] - m["graphrunner_prefix_cache_hits_total"]


def test_n_seeded_choices_are_each_the_request_alone_with_seed_plus_i(server: Server) -> None:
    answer = _complete(server, n=3, seed=7)
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    alone = [_complete(server, seed=7 + i)["choices"][0]["token_ids"] for i in range(3)]
    assert [c["token_ids"] for c in choices] == alone
    assert len({tuple(t) for t in alone}) > 1, "three seeds drew the same tokens"
    again = _complete(server, n=3, seed=7)
    assert [c["token_ids"] for c in again["choices"]] == alone
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(PROMPT)  # counted once
    assert usage["completion_tokens"] == sum(len(t) for t in alone)
    assert usage["total_tokens"] == len(PROMPT) + usage["completion_tokens"]


def test_the_prompt_is_prefilled_once_for_all_choices(server: Server) -> None:
    prompt = [(t * 7 + 1) % 256 for t in PROMPT] * 3  # seen by no other test
    before = _computed_prompt_tokens(server)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 1, "n": 4}
    status, _, answer = server.post("/v1/completions", body)
    assert status == 200, answer
    assert len(answer["choices"]) == 4
    # The first choice computes the prompt; each other one its last token only
    # (the cache never holds a prompt's last token: its logits are needed).
    assert _computed_prompt_tokens(server) - before == len(prompt) + 3


def test_streamed_choices_carry_their_index_and_join_to_the_whole(server: Server) -> None:
    whole = _complete(server, n=2, seed=11)
    body = {
        "prompt": PROMPT,
        "max_tokens": NEW,
        "temperature": 1.0,
        "seed": 11,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = list(server.stream("/v1/completions", body))
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finishes: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        tokens[choice["index"]] += choice.get("token_ids", [])
        finishes[choice["index"]].append(choice["finish_reason"])
    assert [tokens[0], tokens[1]] == [c["token_ids"] for c in whole["choices"]]
    for i in (0, 1):
        assert finishes[i][-1] == whole["choices"][i]["finish_reason"]
        assert not any(finishes[i][:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == sum(
        len(t) for t in tokens.values()
    )


def test_greedy_choices_are_alike(server: Server) -> None:
    answer = _complete(server, n=3, temperature=0.0)
    first = answer["choices"][0]["token_ids"]
    assert all(c["token_ids"] == first for c in answer["choices"])


def test_a_client_gone_mid_stream_aborts_every_choice(server: Server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": 3, "stream": True}
    events = cast(Generator[Any, None, None], server.stream("/v1/completions", body))
    next(events)
    events.close()  # the connection closes: every choice is aborted
    m = server.idle_metrics()
    assert m["graphrunner_requests_running"] == 0 and m["graphrunner_kv_slots_used"] == 0
