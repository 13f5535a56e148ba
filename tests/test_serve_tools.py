"""Tool calls through ``graphrunner serve`` and the ``openai`` client, on a
tiny Llama whose chat template declares tools (Hermes / Qwen format): a
named or required ``tool_choice`` holds the answer to a call whose arguments
follow the function's schema, parsed into ``tool_calls`` (``arguments`` a
JSON string, ``"{}"`` when empty) with ``finish_reason`` ``tool_calls``,
streamed (content as it comes, a call's name once read, its arguments
as they are written) and not, the two alike; the call and its result go back in the next turn; the
model's own ``<tool_call>`` text is parsed under ``auto`` and left as text
under ``none``; bad tools and choices are a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gguf_world import tiny_text_checkpoint
from graphrunner_ref.serve.tools import parse_tool_calls
from serve_world import Server

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

#: A Hermes-style template: the tools in a system turn, earlier calls as
#: <tool_call> blocks, results as tool turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "w",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"c": {"enum": ["x", "y"]}},
            "required": ["c"],
            "additionalProperties": False,
        },
    },
}
NOW = {
    "type": "function",
    "function": {
        "name": "t",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "hi"}]
NEW = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ckpt = tmp_path_factory.mktemp("tools") / "hf"
    tiny_text_checkpoint(ckpt)
    config_path = ckpt / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    (ckpt / "chat_template.jinja").unlink(missing_ok=True)
    args = ("--runner", "cpu", "--max-bs", "2", "--capture-sizes", "1,2")
    with Server(str(ckpt), *args, "--served-model-name", "tiny") as s:
        yield s
        assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def client(server: Server) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_a_named_tool_choice_calls_it_with_arguments_of_its_schema(client: Any) -> None:
    answer = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, NOW], tool_choice=_named("w"), max_tokens=NEW
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "w" and call.id.startswith("call_")
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) in ({"c": "x"}, {"c": "y"})


def test_empty_arguments_are_an_empty_json_object(client: Any) -> None:
    answer = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, NOW], tool_choice=_named("t"), max_tokens=NEW
    )
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "t" and call.function.arguments == "{}"


def test_required_calls_one_of_the_tools(client: Any) -> None:
    answer = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, NOW], tool_choice="required", max_tokens=NEW
    )
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name in ("w", "t")
    assert answer.choices[0].finish_reason == "tool_calls"


def test_a_call_round_trips_into_the_next_turn(client: Any) -> None:
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice=_named("w"), max_tokens=NEW
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result went in


def _streamed(client: Any, **fields: Any) -> tuple[list[Any], str | None, list[Any], str]:
    """A streamed answer's chunks, and its content, ``(id, name, arguments)``
    of each call and finish reason as a client joins them."""
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, stream=True, **fields))
    deltas = [ch.choices[0].delta for ch in chunks]
    calls: dict[int, list[str]] = {}
    for call in (c for d in deltas for c in d.tool_calls or []):
        entry = calls.setdefault(call.index, ["", "", ""])
        if call.id is not None:
            assert not entry[0], "a call's id came twice"
            entry[0] = call.id
        entry[1] += call.function.name or ""
        entry[2] += call.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    content = "".join(d.content or "" for d in deltas) or None
    return chunks, content, [tuple(c) for c in calls.values()], chunks[-1].choices[0].finish_reason


def _forced(text: str) -> dict[str, Any]:
    """Fields that hold the answer to ``text`` under ``tool_choice`` auto."""
    return {"tools": [WEATHER, NOW], "extra_body": {"structured_outputs": {"choice": [text]}}}


CALL_W = '<tool_call>{"name": "w", "arguments": {"c": "y"}}</tool_call>'
TWO_CALLS = '<tool_call>{"name":"t"}</tool_call><tool_call>{"name":"t","arguments":{}}</tool_call>'


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [WEATHER, NOW], "tool_choice": _named("w")},
        {"tools": [WEATHER, NOW], "tool_choice": "required"},
        {"tools": [WEATHER, NOW], "tool_choice": "auto"},
        _forced(f"ok {CALL_W}"),
        _forced(TWO_CALLS),
        _forced("no <tool_call>{bad}</tool_call>"),
    ],
    ids=["named", "required", "auto", "auto-content-then-call", "auto-two-calls", "auto-bad"],
)
def test_streamed_deltas_join_into_the_whole_answer(client: Any, fields: dict[str, Any]) -> None:
    fields = {"max_tokens": NEW, "temperature": 0, "seed": 7, **fields}
    whole = client.chat.completions.create(model="tiny", messages=ASK, **fields).choices[0]
    chunks, content, calls, finish = _streamed(client, **fields)
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert content == whole.message.content
    assert [(name, arguments) for _, name, arguments in calls] == expected
    assert all(id_.startswith("call_") for id_, _, _ in calls)
    assert finish == whole.finish_reason and (finish == "tool_calls") == bool(calls)
    tokens = [t for ch in chunks for t in getattr(ch.choices[0], "token_ids", None) or []]
    assert tokens == whole.token_ids  # vLLM's extension: every token once, in order


def test_a_calls_arguments_stream_in_pieces_after_its_name(client: Any) -> None:
    chunks, _, calls, finish = _streamed(
        client, tools=[WEATHER], tool_choice=_named("w"), max_tokens=NEW, temperature=0
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c for ch in chunks for c in ch.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.function.name, first.function.arguments) == (0, "w", "")
    assert len(rest) > 1 and all(d.function.arguments and d.id is None for d in rest)
    assert json.loads(calls[0][2]) in ({"c": "x"}, {"c": "y"}) and finish == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks)


def test_content_before_a_call_streams_before_it(client: Any) -> None:
    chunks, content, calls, _ = _streamed(client, max_tokens=NEW, **_forced(f"ok {CALL_W}"))
    said = [k for k, ch in enumerate(chunks) if ch.choices[0].delta.content]
    called = [k for k, ch in enumerate(chunks) if ch.choices[0].delta.tool_calls]
    assert content == "ok" and [(n, a) for _, n, a in calls] == [("w", '{"c": "y"}')]
    assert said and called and said[-1] < called[0]
    # ... before the call's first tokens were made, not with it at its end
    assert any(getattr(ch.choices[0], "token_ids", None) for ch in chunks[said[-1] + 1 : called[0]])
    assert not any("<" in (ch.choices[0].delta.content or "") for ch in chunks)


def test_two_calls_stream_with_indexes_0_and_1(client: Any) -> None:
    chunks, content, calls, finish = _streamed(client, max_tokens=NEW, **_forced(TWO_CALLS))
    assert content is None and finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [("t", "{}"), ("t", "{}")]
    assert calls[0][0] != calls[1][0]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": [WEATHER], "tool_choice": _named("nope")}, "tool_choice", ["'nope'"]),
        ({"tool_choice": "required"}, "tool_choice", ["without tools"]),
        ({"tools": [{"type": "function"}]}, "tools[0].function", ["expected an object"]),
        ({"tools": [{"type": "web"}]}, "tools[0]", ["'type': 'function'"]),
        ({"tools": [WEATHER, WEATHER]}, "tools", ["each once"]),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            ["expected one of them"],
        ),
    ],
)
def test_bad_tools_are_refused_by_name(
    server: Server, fields: dict[str, Any], param: str, words: list[str]
) -> None:
    status, _, answer = server.post("/v1/chat/completions", {"messages": ASK, **fields})
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert all(w in answer["error"]["message"] for w in words), answer


def test_parsing_keeps_the_text_around_calls_and_refuses_broken_blocks() -> None:
    text = 'sure <tool_call>\n{"name": "w", "arguments": {"c": "x"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "sure" and calls[0]["function"] == {"name": "w", "arguments": '{"c": "x"}'}
    content, calls = parse_tool_calls('<tool_call>{"name": "t"}</tool_call>')
    assert content is None and calls[0]["function"]["arguments"] == "{}"
    broken = "<tool_call>{not json</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls("no call") == ("no call", [])


def test_a_template_without_tools_refuses_them(tmp_path: Path) -> None:
    ckpt = tmp_path / "hf"
    tiny_text_checkpoint(ckpt)
    with Server(str(ckpt), "--runner", "eager", "--max-bs", "1") as s:
        # No --served-model-name: the model is named by its path.
        status, _, models = s.request("GET", "/v1/models")
        assert status == 200 and models["data"][0]["id"] == str(ckpt)
        status, _, answer = s.post("/v1/chat/completions", {"messages": ASK, "tools": [WEATHER]})
        assert status == 400 and answer["error"]["param"] == "tools"
        assert "declares no tools" in answer["error"]["message"]
        assert s.stop() == 0
