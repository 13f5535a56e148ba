"""``graphrunner serve`` with a checkpoint's tokenizer and chat template
(a tiny trained-tokenizer Llama): chat and text completions, streamed and
not, through the HTTP API and the official ``openai`` client: the role
first, the deltas joining to the whole answer, ``finish_reason`` on the
last, usage counts equal to the tokenizer's, stop strings, and greedy chat
answers equal to ``generate --chat``'s."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import graphrunner_ref.cli.main as cli
from gguf_world import tiny_text_checkpoint
from serve_world import Server

MESSAGES = [
    {"role": "system", "content": "answer briefly"},
    {"role": "user", "content": "what is the capital of france?"},
]
NEW = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve-text") / "hf"
    tiny_text_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(ckpt: Path) -> Any:
    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[Server]:
    with Server(
        str(ckpt), "--runner", "eager", "--max-bs", "4", "--served-model-name", "tiny"
    ) as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


def _chat(server: Server, **fields: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": NEW, **fields}
    status, _, answer = server.post("/v1/chat/completions", body)
    assert status == 200, answer
    return dict(answer)


def test_chat_answers_whole_with_the_tokenizers_counts(server: Server, tokenizer: Any) -> None:
    answer = _chat(server)
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion"
    assert choice["message"]["role"] == "assistant"
    ids = choice["token_ids"]
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    counts = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
    }
    assert {k: answer["usage"][k] for k in counts} == counts
    ended = ids[-1] == tokenizer.eos_token_id
    assert choice["finish_reason"] == ("stop" if ended else "length")


def test_streamed_chat_deltas_join_to_the_whole_answer(server: Server) -> None:
    whole = _chat(server)
    body = {"messages": MESSAGES, "max_tokens": NEW, "stream": True}
    events = list(
        server.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    )
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], [e for e in events[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all("role" not in d for d in deltas[1:])
    assert (
        "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]
    )
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == whole["choices"][0]["finish_reason"] and not any(finishes[:-1])
    # The same conversation again: all of it but the last token was cached.
    cached = {"cached_tokens": whole["usage"]["prompt_tokens"] - 1}
    assert usage["choices"] == []
    assert usage["usage"] == {**whole["usage"], "prompt_tokens_details": cached}


def test_the_role_chunk_leaves_with_the_first_token(server: Server) -> None:
    """A request waiting for a free row sends nothing, its role chunk
    included, until its first token: the four rows run long answers, and a
    fifth stream's first chunk arrives only after one of them has ended."""
    done: list[float] = []
    started = threading.Barrier(5)

    def run_long() -> None:
        body = {"messages": MESSAGES, "max_tokens": 48, "ignore_eos": True, "stream": True}
        for n, event in enumerate(server.stream("/v1/chat/completions", body)):
            if n == 0:
                started.wait(60)
            if event == "[DONE]":
                done.append(time.perf_counter())

    runners = [threading.Thread(target=run_long) for _ in range(4)]
    for t in runners:
        t.start()
    started.wait(60)  # every row holds a request that has its first token
    body = {"messages": MESSAGES, "max_tokens": 2, "stream": True}
    first = next(iter(server.stream("/v1/chat/completions", body)))
    arrived = time.perf_counter()
    for t in runners:
        t.join(120)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(done) == 4 and arrived >= min(done) - 0.01, (arrived, sorted(done))


def test_text_completions_streamed_and_not(server: Server, tokenizer: Any) -> None:
    prompt = "hello world, hello"
    status, _, whole = server.post("/v1/completions", {"prompt": prompt, "max_tokens": NEW})
    assert status == 200
    assert whole["usage"]["prompt_tokens"] == len(tokenizer(prompt)["input_ids"])
    body = {"prompt": prompt, "max_tokens": NEW, "stream": True}
    events = list(server.stream("/v1/completions", body))
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"]


def test_a_stop_string_ends_the_answer_before_it(server: Server) -> None:
    free = _chat(server, max_tokens=40)["choices"][0]["message"]["content"]
    stop = free.strip()[3:6]
    if len(stop) < 2:
        pytest.skip(f"the random model's answer {free!r} is too short to stop in")
    answer = _chat(server, max_tokens=40, stop=[stop])["choices"][0]
    assert answer["message"]["content"] == free[: free.index(stop)]
    assert answer["finish_reason"] == "stop" and answer["stop_reason"] == stop
    events = list(
        server.stream(
            "/v1/chat/completions",
            {"messages": MESSAGES, "max_tokens": 40, "stop": stop, "stream": True},
        )
    )
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == answer["message"]["content"]


def test_include_stop_str_in_output_keeps_the_stop_string(server: Server) -> None:
    """vLLM's field: the answer ends after its stop string, whole and streamed."""
    free = _chat(server, max_tokens=40)["choices"][0]["message"]["content"]
    stop = free.strip()[3:6]
    if len(stop) < 2:
        pytest.skip(f"the random model's answer {free!r} is too short to stop in")
    fields = {"stop": [stop], "include_stop_str_in_output": True}
    answer = _chat(server, max_tokens=40, **fields)["choices"][0]
    assert answer["message"]["content"] == free[: free.index(stop)] + stop
    assert answer["finish_reason"] == "stop" and answer["stop_reason"] == stop
    body = {"messages": MESSAGES, "max_tokens": 40, "stream": True, **fields}
    events = list(server.stream("/v1/chat/completions", body))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == answer["message"]["content"]


def test_spaces_between_special_tokens_false_is_refused_by_name(server: Server) -> None:
    body = {"messages": MESSAGES, "spaces_between_special_tokens": False}
    status, _, answer = server.post("/v1/chat/completions", body)
    assert status == 400 and "spaces_between_special_tokens=False" in answer["error"]["message"]


def test_greedy_chat_equals_generate_chat(
    server: Server, ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    question = MESSAGES[1]["content"]
    argv = ["generate", "--model", str(ckpt), "--chat", "--prompt", question, "--json"]
    assert cli.main([*argv, "--runner", "eager", "--max-new-tokens", str(NEW), "--quiet"]) == 0
    expected = json.loads(capsys.readouterr().out)["token_ids"]
    answer = _chat(server, messages=[MESSAGES[1]])
    assert answer["choices"][0]["token_ids"] == expected


def test_the_openai_client_chats_streamed_and_not(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    assert model.id == "tiny"
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=NEW)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=NEW,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    assert "messages" in str(bad.value)


def test_log_probabilities_the_server_does_not_collect_are_refused(server: Server) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hello", "logprobs": 1}),
        ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True}),
    ):
        status, _, answer = server.post(path, body)
        assert status == 400 and "--logprobs N" in answer["error"]["message"], answer


def test_tokenize_gives_the_tokenizer_s_ids_and_detokenize_inverts_them(
    server: Server, tokenizer: Any
) -> None:
    """vLLM's utility routes, as its load generator calls them: the ids the
    tokenizer gives, the count and the context; back to the same text."""
    text = "hello world, hello"
    status, _, body = server.post("/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200, body
    ids = tokenizer(text)["input_ids"]
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    status, _, models = server.request("GET", "/v1/models")
    assert body["max_model_len"] == models["data"][0]["max_model_len"]
    plain = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})[2]
    assert plain["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] is None
    status, _, back = server.post("/detokenize", {"model": "tiny", "tokens": ids})
    assert status == 200 and back == {"prompt": tokenizer.decode(ids)}


def test_tokenize_renders_messages_as_a_chat_completion_counts_them(server: Server) -> None:
    counted = server.post("/tokenize", {"messages": MESSAGES})[2]
    usage = _chat(server, max_tokens=1)["usage"]
    assert counted["count"] == usage["prompt_tokens"] == len(counted["tokens"])


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("/tokenize", {}, ["neither given"]),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, ["both given"]),
        (
            "/tokenize",
            {"messages": MESSAGES, "add_generation_prompt": False},
            ["add_generation_prompt=False", "expected true"],
        ),
        ("/tokenize", {"prompt": "a", "truncate": 3}, ["truncate"]),
        ("/detokenize", {"tokens": [1, 10**6]}, ["token id 1000000", "expected ids in 0.."]),
        ("/detokenize", {"tokens": "12"}, ["tokens"]),
    ],
)
def test_a_bad_utility_body_is_a_400_naming_the_field(
    server: Server, path: str, body: dict[str, Any], words: list[str]
) -> None:
    status, _, answer = server.post(path, body)
    assert status == 400, answer
    for word in words:
        assert word in answer["error"]["message"], answer["error"]["message"]


def test_utility_routes_refuse_another_model_and_name_the_version(server: Server) -> None:
    from graphrunner import __version__

    status, _, answer = server.post("/tokenize", {"model": "other", "prompt": "a"})
    assert status == 404 and "not served here" in answer["error"]["message"]
    assert server.request("GET", "/version")[2] == {"version": __version__}
