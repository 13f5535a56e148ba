"""The incremental tool-call parser (:class:`ToolCallParser`) on hand-written
text cut into deltas: content streams up to a possible ``<tool_call>`` and
never shows a tag's text; a call's name goes out once read, its arguments in
pieces as written; several calls take indexes 0, 1, ...; a block that is no
call stays content; and however the text is cut, the deltas join into what
:func:`parse_tool_calls` makes of the whole text (the non-streamed answer)."""

from __future__ import annotations

from typing import Any

import pytest

from graphrunner_ref.serve.tools import ToolCallParser, parse_tool_calls

W = '<tool_call>\n{"name": "w", "arguments": {"c": "x<y", "n": [1, {"d": "}"}]}}\n</tool_call>'
CASES = [
    "plain text, no call",
    "  spaced  ",
    f"sure {W}",
    f"{W}\n{W} then text",
    '<tool_call>{"name": "t"}</tool_call>',
    '<tool_call>{"name":"t","arguments":null}</tool_call>',
    '<tool_call>{"name": "t", "arguments": "{\\"a\\": 1}"}</tool_call>',
    "<tool_call>{not json}</tool_call> after",
    '<tool_call>{"name": "w" "arguments": {}}</tool_call>',
    '<tool_call>{"name": "w", "arguments": {"c": x}}</tool_call>',
    '<tool_call>{"name": "w", "arguments": {"c": "cut',
    "a <tool_cat> b <tool_call",
    "x < y <<tool_call>{</tool_call>",
]


def fed(pieces: list[str]) -> list[dict[str, Any]]:
    parser = ToolCallParser()
    bodies = [b for p in pieces for b in parser.feed(p)]
    return bodies + parser.finish()


def joined(bodies: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, str]]]:
    """The content and ``(name, arguments)`` of each call, as a client joins deltas."""
    content = "".join(b.get("content", "") for b in bodies)
    calls: dict[int, list[str]] = {}
    for body in bodies:
        for call in body.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name", "")
            entry[1] += call["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content or None, [(name, arguments) for name, arguments in calls.values()]


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text", CASES)
def test_any_cut_of_the_text_joins_into_the_whole_answer(text: str) -> None:
    expected = whole(text)
    assert joined(fed(list(text))) == expected  # a character at a time
    for cut in range(len(text) + 1):
        assert joined(fed([text[:cut], text[cut:]])) == expected, cut


def test_the_whole_answer_reads_calls_and_the_content_around_them() -> None:
    assert whole(f"sure {W}") == (
        "sure",
        [("w", '{"c": "x<y", "n": [1, {"d": "}"}]}')],
    )
    assert whole(f"{W}\n{W} then text")[0] == "then text"
    assert whole(CASES[4]) == (None, [("t", "{}")])
    assert whole(CASES[5]) == (None, [("t", "{}")])
    assert whole(CASES[6]) == (None, [("t", '{"a": 1}')])  # a string is its text
    assert whole("  spaced  ") == ("spaced", [])


def test_a_tag_split_across_deltas_never_reaches_the_content() -> None:
    parser = ToolCallParser()
    assert parser.feed("hi <tool") == [{"content": "hi"}]
    assert parser.feed('_call>{"name": "w"') == []
    (start,) = parser.feed(", ")
    (call,) = start["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "w", "arguments": ""}
    rest = parser.feed('"arguments": {"c": 1}}</tool_call>') + parser.finish()
    assert rest == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"c": 1}'}}]}]


def test_text_that_only_looks_like_a_tag_is_content() -> None:
    parser = ToolCallParser()
    assert parser.feed("a <tool_ca") == [{"content": "a"}]
    assert parser.feed("t> b") == [{"content": " <tool_cat> b"}]
    assert parser.feed(" <") == []
    assert parser.feed(" c") == [{"content": " < c"}]
    assert parser.finish() == [] and parser.calls == []


def test_arguments_stream_in_pieces_after_the_name() -> None:
    bodies = fed(list(W))
    calls = [c for b in bodies for c in b.get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "w", "arguments": ""}
    fragments = [c["function"]["arguments"] for c in calls[1:]]
    assert len(fragments) > 1 and all(fragments)
    assert "".join(fragments) == '{"c": "x<y", "n": [1, {"d": "}"}]}'
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])


def test_two_calls_take_indexes_0_and_1() -> None:
    parser = ToolCallParser()
    bodies = fed([W, " and ", W.replace('"w"', '"v"')])
    starts = [c for b in bodies for c in b.get("tool_calls", []) if "id" in c]
    assert [(c["index"], c["function"]["name"]) for c in starts] == [(0, "w"), (1, "v")]
    assert starts[0]["id"] != starts[1]["id"]
    arguments = '{"c": "x<y", "n": [1, {"d": "}"}]}'
    assert joined(bodies) == ("and", [("w", arguments), ("v", arguments)])
    assert parser.calls == []  # a fresh parser read nothing


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"name": 7}</tool_call>',
        '<tool_call>{"name": "two words"}</tool_call>',
        '<tool_call>{"name": "w" "arguments": {}}</tool_call>',
        '<tool_call>{"name": "w"',
    ],
)
def test_a_block_without_a_call_head_stays_content(text: str) -> None:
    parser = ToolCallParser()
    bodies = [b for ch in text for b in parser.feed(ch)] + parser.finish()
    assert parser.calls == [] and not any("tool_calls" in b for b in bodies)
    assert joined(bodies) == (text, []) == whole(text)


def test_a_call_keeps_the_arguments_the_model_wrote() -> None:
    # Once the name is read the call stands: broken JSON is passed on as
    # written (as OpenAI's arguments are), cut where the block or answer ends.
    assert whole(CASES[9]) == (None, [("w", '{"c": x}')])
    assert whole(CASES[10]) == (None, [("w", '{"c": "cut')])
    assert whole('<tool_call>{"name": "w", "arguments": {"c": 1</tool_call> b') == (
        "b",
        [("w", '{"c": 1')],
    )
    assert whole('<tool_call>{"name": "w", "parameters": {"c": 1}}</tool_call>') == (
        None,
        [("w", "{}")],
    )
