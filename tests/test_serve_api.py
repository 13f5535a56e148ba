"""``graphrunner serve`` on the embedded model (token ids, no tokenizer):
greedy answers equal ``generate``'s at any concurrency, seeded ones equal the
same request alone, streamed tokens equal the whole answer's, usage counts
are exact, clients that go away free every KV slot and request row, and bad
requests get OpenAI's error object naming the field (a real server on a free
port, the eager runner)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import graphrunner_ref.cli.main as cli
from serve_world import Server

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
NEW = 12


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # Without the prefix cache: a cached prefix was prefilled by another
    # request, split elsewhere, and its last bits may differ from generate's
    # (tests/test_serve_prefix_cache.py holds the cache's answers).
    args = ("--runner", "eager", "--max-bs", "8", "--logprobs", "2", "--no-prefix-caching")
    with Server(*args, "--api-key", KEY) as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def _generate(prompts: list[list[int]], tmp: Path, capsys: pytest.CaptureFixture[str]) -> list[Any]:
    path = tmp / "prompts.txt"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    argv = ["generate", "--prompts", str(path), "--json", "--runner", "eager", "--quiet"]
    argv.append("--no-prefix-caching")
    assert cli.main([*argv, "--max-new-tokens", str(NEW), "--max-bs", "8"]) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]


def _tokens(server: Server, prompt: list[int], **fields: Any) -> list[int]:
    status, _, body = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": NEW, **fields}, headers=AUTH
    )
    assert status == 200, body
    return list(body["choices"][0]["token_ids"])


def test_greedy_answers_equal_generate_at_concurrency_8(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _prompts(32)
    expected = _generate(prompts, tmp_path, capsys)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _tokens(server, p), prompts))
    assert got == expected
    alone = [_tokens(server, p) for p in prompts[:3]]
    assert alone == expected[:3]


def test_a_seeded_request_draws_the_same_tokens_whatever_else_runs(server: Server) -> None:
    prompts = _prompts(16, seed=1)
    sampled = {"temperature": 0.9, "top_k": 50, "top_p": 0.95}
    alone = [_tokens(server, p, seed=100 + i, **sampled) for i, p in enumerate(prompts[:4])]
    with ThreadPoolExecutor(8) as pool:
        crowd = list(
            pool.map(
                lambda ip: (
                    _tokens(server, ip[1], seed=100 + ip[0], **sampled)
                    if ip[0] < 4
                    else _tokens(server, ip[1])
                ),
                enumerate(prompts),
            )
        )
    assert crowd[:4] == alone
    assert len({tuple(t) for t in alone}) > 1  # sampling did something


def test_streamed_tokens_equal_the_whole_answer_and_usage_is_exact(server: Server) -> None:
    prompt = [5, 6, 7, 8, 9]
    status, _, whole = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": NEW, "logprobs": 2}, headers=AUTH
    )
    assert status == 200
    assert whole["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": NEW,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 0},  # the cache is off
    }
    assert whole["choices"][0]["finish_reason"] == "length"
    logprobs = whole["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == NEW and all(
        len(t) == 2 for t in logprobs["top_logprobs"]
    )
    body = {"prompt": prompt, "max_tokens": NEW, "stream": True}
    events = list(
        server.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}}, AUTH)
    )
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]


def test_clients_that_go_away_free_every_slot_and_row(server: Server) -> None:
    before = server.idle_metrics()
    assert before["graphrunner_kv_slots_used"] == 0
    body = {"prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    for _ in range(20):
        events = server.stream("/v1/completions", body, AUTH)
        assert next(events)["choices"][0]["token_ids"]
        events.close()  # the connection closes mid-answer
    after = server.idle_metrics()
    generated = (
        after["graphrunner_generation_tokens_total"] - before["graphrunner_generation_tokens_total"]
    )
    assert generated < 20 * 200 / 4  # cut near where each client left, not run to the end
    assert after["graphrunner_kv_slots_used"] == 0
    assert after["graphrunner_request_rows_used"] == 0
    assert after["graphrunner_kv_slots_total"] == before["graphrunner_kv_slots_total"]
    status, _, text = server.request("GET", "/metrics")
    assert 'graphrunner_requests_total{outcome="aborted"}' in text
    assert len(_tokens(server, [1, 2, 3])) == NEW  # and it still answers


def test_models_health_and_metrics(server: Server) -> None:
    status, _, body = server.request("GET", "/v1/models", headers=AUTH)
    assert status == 200 and body["data"][0]["id"] == "embedded"
    assert server.request("GET", "/health")[0] == 200
    m = server.metrics()
    for name in (
        "graphrunner_kv_slots_total",
        "graphrunner_request_rows_total",
        "graphrunner_prompt_tokens_total",
        "graphrunner_generation_tokens_total",
        "graphrunner_graph_replays_total",
        "graphrunner_eager_fallbacks_total",
        "graphrunner_padded_rows_total",
        "graphrunner_time_to_first_token_seconds_count",
        "graphrunner_inter_token_latency_seconds_count",
    ):
        assert name in m, name


#: (body, status, param, words the message holds) of each bad request.
BAD = [
    (b'{"prompt": [1, 2', 400, None, ["not valid JSON"]),
    (b"[1, 2]", 400, None, ["expected a JSON object"]),
    ({"prompt": [1], "max_tokens": "ten"}, 400, "max_tokens", ['"ten"', "integer"]),
    ({"prompt": [1], "max_tokens": -1}, 400, "max_tokens", ["-1", "greater than or equal to 1"]),
    ({"prompt": [1], "max_tokens": 10**9}, 400, "max_tokens", ["1000000000", "expected 1.."]),
    ({"prompt": [1], "temperature": -0.5}, 400, "temperature", ["-0.5", ">= 0"]),
    ({"prompt": [1], "stop": 5}, 400, "stop", ["5"]),
    ({"prompt": [1], "stop": [""]}, 400, "stop", ["1..256 characters"]),
    ({"prompt": [1], "n": 17}, 400, "n", ["n=17", "expected an int in 1..16"]),
    ({"prompt": [1], "n": 0}, 400, "n", ["n=0", "expected an int in 1..16"]),
    ({"prompt": [1], "frobnicate": 1}, 400, "frobnicate", ["not a field"]),
    ({"prompt": []}, 400, "prompt", ["non-empty list of token ids"]),
    ({"prompt": [999]}, 400, "prompt", ["999", "0..255"]),
    ({"prompt": "hello"}, 400, "prompt", ["no tokenizer"]),
    ({"prompt": [1] * 300}, 400, "prompt", ["300 tokens", "at most 256"]),
    ({"prompt": [1], "logprobs": 5}, 400, "logprobs", ["logprobs=5", "0..2"]),
    ({"prompt": [1], "model": "gpt-9"}, 404, "model", ["gpt-9", "embedded"]),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), BAD)
def test_bad_requests_get_an_error_object_naming_the_field(
    server: Server, body: Any, status: int, param: str | None, words: list[str]
) -> None:
    raw = body if isinstance(body, bytes) else None
    got, _, answer = server.post("/v1/completions", None if raw else body, raw=raw, headers=AUTH)
    assert got == status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    assert "Traceback" not in error["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"messages": []}, ["messages=[]", "at least one message"]),
        (
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            ["tools"],
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, ["messages[0].role", "wizard"]),
        ({"messages": [{"role": "user", "content": "hi"}]}, ["no tokenizer"]),
    ],
)
def test_bad_chat_requests_name_the_field(server: Server, body: Any, words: list[str]) -> None:
    status, _, answer = server.post("/v1/chat/completions", body, headers=AUTH)
    assert status == 400, answer
    for word in words:
        assert word in answer["error"]["message"], answer["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_a_missing_or_wrong_api_key_is_401_on_every_v1_route(
    server: Server, headers: dict[str, str]
) -> None:
    for method, path, body in (
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": [1]}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        status, _, answer = server.request(method, path, body, headers=headers)
        assert status == 401, (path, answer)
        assert answer["error"]["type"] == "authentication_error"
        assert "--api-key" in answer["error"]["message"]
    assert server.request("GET", "/health")[0] == 200  # no key needed


def test_tokenize_without_a_tokenizer_is_a_400_naming_the_field(server: Server) -> None:
    status, _, answer = server.post("/tokenize", {"prompt": "hi"}, headers=AUTH)
    assert (
        status == 400 and "prompt: the served model has no tokenizer" in answer["error"]["message"]
    )
    status, _, answer = server.post("/detokenize", {"tokens": [1, 2]}, headers=AUTH)
    assert (
        status == 400 and "tokens: the served model has no tokenizer" in answer["error"]["message"]
    )
    assert server.post("/tokenize", {"prompt": "hi"})[0] == 401  # the key, as on /v1


def test_an_unknown_route_is_404_in_the_error_shape(server: Server) -> None:
    status, _, answer = server.request("GET", "/v1/nothing", headers=AUTH)
    assert status == 404 and "/v1/completions" in answer["error"]["message"]


def test_the_openai_client_gets_the_same_tokens(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    prompt = [3, 1, 4, 1, 5]
    answer = client.completions.create(model="embedded", prompt=prompt, max_tokens=NEW)
    assert answer.usage is not None and answer.usage.completion_tokens == NEW
    extra = answer.choices[0].model_extra or {}
    assert extra["token_ids"] == _tokens(server, prompt)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=prompt, max_tokens=2)
