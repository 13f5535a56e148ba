"""Structured output on ``graphrunner serve`` (a tiny trained-tokenizer Llama,
its random weights, the compiled CPU runner): seeded sampled answers under
five JSON schemas (nested objects, enums, arrays, bounded numbers) all parse
and validate (a small validator written here); greedy constrained answers
are the same alone and in a crowd of free requests; the step stays captured
(no eager fallback); the padding sanitizer passes with constrained and free
rows mixed; vLLM's ``structured_outputs`` (``choice``, ``regex``,
``grammar``, ``json``) follow their grammars; a grammar xgrammar cannot
compile, and a server that cannot follow one, are a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bench.bench_structured import valid
from gguf_world import tiny_text_checkpoint
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.structured import Grammars, grammar_spec
from serve_world import Server

pytest.importorskip("xgrammar")

NEW = 64  # every schema below fits well within it

SCHEMAS: list[dict[str, Any]] = [
    {  # a nested object
        "type": "object",
        "properties": {
            "who": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "ok"],
                "additionalProperties": False,
            },
        },
        "required": ["who"],
        "additionalProperties": False,
    },
    {  # enums
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["s", "m"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    {  # an array of bounded integers
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {  # bounded numbers
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 10, "maximum": 20},
            "x": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["n", "x"],
        "additionalProperties": False,
    },
    {  # an array of objects with short strings
        # (a pattern, not maxLength: xgrammar 0.2.9's maxLength rule admits raw
        # control characters, which no JSON parser takes)
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"type": "string", "pattern": "^[a-z]{1,3}$"}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
]


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("structured") / "hf"
    tiny_text_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[Server]:
    args = ("--runner", "cpu", "--max-bs", "4", "--capture-sizes", "1,2,4")
    with Server(str(ckpt), *args, "--served-model-name", "tiny") as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


def _complete(server: Server, **fields: Any) -> tuple[int, Any]:
    body = {"model": "tiny", "prompt": "the answer:", "max_tokens": NEW, **fields}
    status, _, answer = server.post("/v1/completions", body)
    return status, answer


def _answer(server: Server, **fields: Any) -> dict[str, Any]:
    status, body = _complete(server, **fields)
    assert status == 200, body
    return dict(body["choices"][0])


def _fallbacks(server: Server) -> tuple[float, float]:
    m = server.idle_metrics()
    return m["graphrunner_eager_fallbacks_total"], m["graphrunner_graph_replays_total"]


def test_sampled_answers_parse_and_follow_their_schemas(server: Server) -> None:
    fallbacks, replays = _fallbacks(server)
    asks = [(i, schema) for i, schema in enumerate(SCHEMAS) for _ in range(10)]

    def ask(n: int) -> dict[str, Any]:
        i, schema = asks[n]
        return _answer(server, temperature=1.0, seed=n, response_format=_format(schema))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(asks))))
    for (i, schema), choice in zip(asks, answers, strict=True):
        assert choice["finish_reason"] == "stop", (i, choice)
        assert valid(json.loads(choice["text"]), schema), (i, choice["text"])
    assert len({a["text"] for a in answers}) > len(SCHEMAS)  # sampled: not one answer each
    after = _fallbacks(server)
    assert after[0] == fallbacks and after[1] > replays  # every step replayed, none eager


def test_greedy_constrained_answers_are_the_same_alone_and_in_a_crowd(server: Server) -> None:
    alone = [_answer(server, response_format=_format(s))["token_ids"] for s in SCHEMAS[:3]]

    def ask(n: int) -> list[int]:
        if n % 2:  # a free request between the constrained ones
            return list(_answer(server, temperature=0.8, seed=n, max_tokens=20)["token_ids"])
        return list(_answer(server, response_format=_format(SCHEMAS[n // 2]))["token_ids"])

    with ThreadPoolExecutor(6) as pool:
        crowd = list(pool.map(ask, range(6)))
    assert crowd[0::2] == alone


def test_vllm_structured_outputs_follow_their_grammars(server: Server) -> None:
    choice = _answer(server, structured_outputs={"choice": ["yes", "no", "maybe so"]})
    assert choice["text"] in ("yes", "no", "maybe so")
    regex = _answer(server, temperature=1.0, seed=2, structured_outputs={"regex": "[a-c]{2,4}x"})
    assert re.fullmatch("[a-c]{2,4}x", regex["text"]), regex
    grammar = _answer(server, structured_outputs={"grammar": 'root ::= "a" [bc] [bc]? "."'})
    assert re.fullmatch("a[bc]{1,2}[.]", grammar["text"]), grammar
    schema = json.dumps(SCHEMAS[1])  # vLLM takes a schema as JSON text too
    text = _answer(server, structured_outputs={"json": schema})["text"]
    assert valid(json.loads(text), SCHEMAS[1]), text
    for _ in range(2):  # the chat endpoint, through its template
        status, _, body = server.post(
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "a color?"}],
                "max_tokens": NEW,
                "response_format": _format(SCHEMAS[1]),
            },
        )
        assert status == 200, body
        assert valid(json.loads(body["choices"][0]["message"]["content"]), SCHEMAS[1])


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": _format({"type": "objectx"})}, "response_format.json_schema.schema",
         "objectx"),
        ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs.regex", "xgrammar"),
        ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs.grammar",
         "xgrammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "2 grammars"),
        ({"structured_outputs": {"json_schema": {}}}, "structured_outputs", "json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
        ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens", "grammar"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs", "both"),
    ],
)  # fmt: skip
def test_a_grammar_that_cannot_compile_is_a_400_naming_the_part(
    server: Server, fields: dict[str, Any], param: str, says: str
) -> None:
    status, body = _complete(server, **fields)
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert param in body["error"]["message"] and says in body["error"]["message"], body


def test_the_sanitizer_passes_constrained_and_free_rows_mixed(ckpt: Path, server: Server) -> None:
    def ask(s: Server, n: int) -> list[int]:
        if n % 2:
            return list(_answer(s, temperature=0.7, seed=n, max_tokens=12)["token_ids"])
        fields = {"temperature": 1.0, "seed": n, "response_format": _format(SCHEMAS[n % 5])}
        return list(_answer(s, **fields)["token_ids"])

    args = ("--runner", "eager", "--max-bs", "4", "--check-padding")
    with Server(str(ckpt), *args, "--served-model-name", "tiny") as checked:
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda n: ask(checked, n), range(6)))
        assert checked.stop() == 0, "".join(checked.log)
    with ThreadPoolExecutor(6) as pool:  # the same tokens as the compiled runner's
        assert got == list(pool.map(lambda n: ask(server, n), range(6)))


def test_a_server_that_cannot_follow_a_grammar_refuses_it_by_name(ckpt: Path) -> None:
    spec = grammar_spec({"response_format": {"type": "json_object"}})
    cases = [
        (EngineConfig(model=str(ckpt), steps_per_launch=2), object(), "--steps-per-launch 2"),
        (EngineConfig(model=str(ckpt), overlap=True), object(), "--overlap"),
        (EngineConfig(), None, "no tokenizer"),
    ]
    for config, codec, says in cases:
        grammars = Grammars(config, codec, 320, 2)  # type: ignore[arg-type]
        with pytest.raises(APIError, match=says) as info:
            asyncio.run(grammars.factory(spec))
        assert info.value.param == "response_format"
