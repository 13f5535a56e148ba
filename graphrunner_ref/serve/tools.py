"""Tool calls on ``/v1/chat/completions``, in the Hermes / Qwen format.

A request's ``tools`` (OpenAI's function tools) go to the checkpoint's chat
template, which must declare them (it reads ``tools``); the model answers a
call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which
:class:`ToolCallParser` turns into OpenAI's ``tool_calls`` deltas as the
answer streams (``arguments`` always a string, ``"{}"`` when empty) and
:func:`parse_tool_calls` reads the same way from a whole answer, with the
finish reason ``tool_calls``. ``tool_choice``:

- ``auto`` (the default with tools): the model chooses; its calls are parsed;
- ``none``: no call is parsed (the template still sees the tools);
- ``required``, or a named function: the answer is held to a call, of any
  tool or of that one, with arguments that follow its ``parameters``
  schema, through the structured-output path (:func:`call_grammar`, a
  grammar the step masks with, as a JSON schema's).

Earlier calls and their results come back as messages: an assistant message
with ``tool_calls`` (its ``arguments`` JSON text handed to the template as an
object, as vLLM does) and ``tool`` messages with ``tool_call_id``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError, shown

__all__ = [
    "MAX_TOOLS",
    "CallGrammar",
    "ToolCallParser",
    "Tools",
    "call_grammar",
    "parse_tool_calls",
    "template_messages",
    "tools_of",
]

#: Tools one request may declare.
MAX_TOOLS = 64
_START, _END = "<tool_call>", "</tool_call>"
_MAX_NAME = 64
_NAME = re.compile(rf"^[A-Za-z0-9_.-]{{1,{_MAX_NAME}}}$")


@dataclass(frozen=True, slots=True)
class Tools:
    """A request's tools: ``functions`` as the chat template takes them
    (``{"type": "function", "function": {...}}`` each), ``choice``
    (``auto``, ``none`` or ``required``) and ``named``, the one function a
    named ``tool_choice`` asks for (else None)."""

    functions: tuple[dict[str, Any], ...]
    choice: str
    named: str | None = None

    @property
    def parsed(self) -> bool:
        """Whether the answer's calls are parsed into ``tool_calls``."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the answer is held to a call (``required`` or named)."""
        return self.choice == "required" or self.named is not None


@dataclass(frozen=True, slots=True)
class CallGrammar:
    """The grammar of a forced call: one of ``calls``, each ``(name,
    parameters schema)``, written ``<tool_call>{...}</tool_call>``."""

    calls: tuple[tuple[str, str], ...]  # (name, the schema as JSON)


def tools_of(tools: Any, tool_choice: Any, codec: TextCodec | None) -> Tools | None:
    """The request's ``tools`` and ``tool_choice`` checked (None: no tools);
    :class:`APIError` 400 naming the field, the value and what was expected."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(
                400,
                f"tool_choice={shown(tool_choice)}: given without tools; expected tools too",
                param="tool_choice",
            )
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools: expected a list of 1..{MAX_TOOLS} tools", param="tools")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: names {names}; expected each once", param="tools")
    _check_template(codec)
    if tool_choice in (None, "auto", "none", "required"):
        return Tools(functions, tool_choice or "auto")
    named = _named(tool_choice)
    if named not in names:
        raise APIError(
            400,
            f"tool_choice: function {named!r} is not among the tools {names}",
            param="tool_choice",
        )
    return Tools(functions, "required", named)


def _function(i: int, tool: Any) -> dict[str, Any]:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(
            400,
            f"{param}={shown(tool)}: expected {{'type': 'function', 'function': {{...}}}}",
            param=param,
        )
    fn = tool.get("function")
    if not isinstance(fn, dict) or not _NAME.match(str(fn.get("name", ""))):
        raise APIError(
            400,
            f"{param}.function={shown(fn)}: expected an object with a name of 1..64 "
            "letters, digits, '_', '.' or '-'",
            param=f"{param}.function",
        )
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise APIError(
            400,
            f"{param}.function.parameters={shown(parameters)}: expected a JSON schema object",
            param=f"{param}.function.parameters",
        )
    kept = {"name": fn["name"], "parameters": parameters}
    if isinstance(fn.get("description"), str):
        kept["description"] = fn["description"]
    return {"type": "function", "function": kept}


def _named(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)):
        raise APIError(
            400,
            f"tool_choice={shown(choice)}: expected none, auto, required or "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    return str(fn.get("name"))


def _check_template(codec: TextCodec | None) -> None:
    template = None if codec is None else codec.tokenizer.chat_template
    if not isinstance(template, str) or "tools" not in template:
        raise APIError(
            400,
            "tools: the checkpoint's chat template declares no tools (it never reads "
            "'tools'); expected a model whose template takes them, or no tools",
            param="tools",
            code="unsupported",
        )


def call_grammar(tools: Tools) -> CallGrammar | None:
    """The grammar a forced call follows (None: the model is free)."""
    if not tools.forced:
        return None
    chosen = [
        (f["function"]["name"], json.dumps(f["function"]["parameters"], sort_keys=True))
        for f in tools.functions
        if tools.named is None or f["function"]["name"] == tools.named
    ]
    return CallGrammar(tuple(chosen))


def template_messages(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``turns`` as a chat template reads them: an assistant's earlier calls'
    ``arguments`` JSON text made an object (as vLLM hands them over)."""
    out = []
    for turn in turns:
        calls = turn.get("tool_calls")
        if calls:
            turn = {**turn, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(turn)
    return out


def _with_object_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"] or "{}")
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and OpenAI ``tool_calls`` of a whole answer's ``text``,
    read as a streamed one is (:class:`ToolCallParser`), so the two agree:
    the content (None when empty) and each call (``arguments`` a string)."""
    parser = ToolCallParser()
    bodies = parser.feed(text) + parser.finish()
    content = "".join(b.get("content", "") for b in bodies)
    return content or None, parser.calls


class ToolCallParser:
    """A growing answer's text read into OpenAI chat deltas, as vLLM's Hermes
    parser streams them: each :meth:`feed` returns the deltas its text makes,
    :meth:`finish` those of the answer's end.

    - Content (``{"content": ...}``) goes out as it comes, less a suffix that
      may be the start of ``<tool_call>`` (no tag's text ever reaches the
      client), and without the whitespace at its two ends (held until more
      content follows, dropped at the end).
    - A block ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>`` is
      call ``k`` (0, 1, ...) once its name is read: a delta with the call's
      ``id``, ``type`` and ``function.name`` (``arguments`` ``""``), then
      ``{"index": k, "function": {"arguments": ...}}`` deltas of ARGS's JSON
      text as the model writes it, so their join is the call's
      ``arguments``. ARGS other than an object or an array is sent whole
      at its end (a string as its text; empty, null, false or 0 as
      ``"{}"``); no ARGS at all is ``"{}"``, never ``""``.
    - A block whose text is not ``{"name": "..."`` (a tool's name: 1..64
      letters, digits, ``_ . -``) followed by ``,`` or ``}`` is no call: its
      text stays content. Once the name is read the call stands: ARGS is
      what the model wrote (OpenAI's ``arguments`` are not checked JSON
      either), up to the end of its JSON value, ``</tool_call>`` or the
      answer's end; the rest of the block is dropped.

    :attr:`calls` holds the calls read so far, whole (``id``, ``type``,
    ``function`` with ``name`` and ``arguments``).
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._text = ""  # read, not yet handed out
        self._state = "content"  # content, head, key, object, value, tail
        self._space = ""  # content's trailing whitespace, held
        self._begun = False  # some content went out (leading whitespace is dropped)
        self._depth, self._quoted, self._escaped = 0, False, False  # in ARGS's JSON

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text``, the answer's next piece, makes."""
        self._text += text
        return self._run(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of the answer's end: all that was held back."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        step = {
            "content": self._content,
            "head": self._head,
            "key": self._key,
            "object": self._object,
            "value": self._value,
            "tail": self._tail,
        }
        while step[self._state](out, final):
            pass
        merged: list[dict[str, Any]] = []
        for body in out:
            if merged and "content" in body and "content" in merged[-1]:
                merged[-1] = {"content": merged[-1]["content"] + body["content"]}
            else:
                merged.append(body)
        return merged

    # Each state reads what it can of self._text; True: read on (the state moved).

    def _content(self, out: list[dict[str, Any]], final: bool) -> bool:
        text = self._text
        at = text.find(_START)
        if at >= 0:
            self._say(out, text[:at])
            self._text, self._state = text[at + len(_START) :], "head"
            return True
        keep = 0 if final else _partial(text, _START)
        self._say(out, text[: len(text) - keep])
        self._text = text[len(text) - keep :]
        return False

    def _say(self, out: list[dict[str, Any]], text: str) -> None:
        text = self._space + text
        if not self._begun:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            self._begun = True
            out.append({"content": body})

    def _head(self, out: list[dict[str, Any]], final: bool) -> bool:
        head = _read_head(self._text)
        if head == _MORE and not final:
            return False
        if not isinstance(head, tuple):  # no call: the tag is content
            self._say(out, _START)
            self._state = "content"
            return True
        name, sep, end = head
        k = len(self.calls)
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        self.calls.append({**call, "function": {"name": name, "arguments": ""}})
        out.append(
            {"tool_calls": [{"index": k, **call, "function": {"name": name, "arguments": ""}}]}
        )
        self._text = self._text[end:]
        if sep == "}":
            self._arguments(out, "{}")
        self._state = "key" if sep == "," else "tail"
        return True

    def _key(self, out: list[dict[str, Any]], final: bool) -> bool:
        text = self._text
        end = _expect(text, 0, ('"arguments"', ":"))
        start = _skip(text, end) if end >= 0 else end
        if start == len(text) or start == _MORE:
            if not final:
                return False
            start = _BAD
        if start == _BAD:  # no arguments
            self._arguments(out, "{}")
            self._state = "tail"
            return True
        self._text = text[start:]
        self._state = "object" if text[start] in "{[" else "value"
        self._depth, self._quoted, self._escaped = 0, False, False
        return True

    def _object(self, out: list[dict[str, Any]], final: bool) -> bool:
        text = self._text
        stop = text.find(_END)
        limit = stop if stop >= 0 else len(text) - (0 if final else _partial(text, _END))
        end, closed = self._scan(text, limit)
        if end:
            self._arguments(out, text[:end])
        self._text = text[end:]
        if closed or stop >= 0 or final:
            self._state = "tail"
            return True
        return False

    def _scan(self, text: str, limit: int) -> tuple[int, bool]:
        """Where ARGS's JSON value ends in ``text[:limit]`` (True) or ``limit``."""
        for i in range(limit):
            c = text[i]
            if self._quoted:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._quoted = False
            elif c == '"':
                self._quoted = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, True
        return limit, False

    def _value(self, out: list[dict[str, Any]], final: bool) -> bool:
        stop = self._text.find(_END)
        if stop < 0 and not final:
            return False
        held = self._text if stop < 0 else self._text[:stop]
        self._arguments(out, _scalar_arguments(held))
        self._text, self._state = self._text[len(held) :], "tail"
        return True

    def _tail(self, out: list[dict[str, Any]], final: bool) -> bool:
        text = self._text
        at = text.find(_END)
        if at >= 0:
            self._text, self._state = text[at + len(_END) :], "content"
            return True
        self._text = "" if final else text[len(text) - _partial(text, _END) :]
        return False

    def _arguments(self, out: list[dict[str, Any]], text: str) -> None:
        k = len(self.calls) - 1
        self.calls[k]["function"]["arguments"] += text
        out.append({"tool_calls": [{"index": k, "function": {"arguments": text}}]})


#: What :func:`_expect` and :func:`_read_head` answer when the text may still
#: grow into what they look for, and when it cannot.
_MORE, _BAD = -1, -2
_SPACE = " \t\n\r"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _partial(text: str, tag: str) -> int:
    """The length of ``text``'s longest suffix that begins ``tag`` (not all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _expect(text: str, i: int, pieces: tuple[str, ...]) -> int:
    """Where ``pieces``, each after optional JSON whitespace, end in ``text``
    from ``i``: ``_MORE`` when the text ends within them, ``_BAD`` when it
    differs."""
    for piece in pieces:
        i = _skip(text, i)
        got = text[i : i + len(piece)]
        if got != piece:
            return _MORE if len(got) < len(piece) and piece.startswith(got) else _BAD
        i += len(piece)
    return i


def _read_head(text: str) -> tuple[str, str, int] | int:
    """A block's ``{"name": "NAME"`` and the ``,`` or ``}`` after it: ``(NAME,
    the separator, where it ends)``, ``_MORE`` or ``_BAD``."""
    start = _expect(text, 0, ("{", '"name"', ":", '"'))
    if start < 0:
        return start
    end = start
    while end < len(text) and text[end] in _NAME_CHARS and end - start < _MAX_NAME:
        end += 1
    if end == len(text):
        return _MORE
    if text[end] != '"' or end == start:
        return _BAD
    sep = _skip(text, end + 1)
    if sep == len(text):
        return _MORE
    if text[sep] not in ",}":
        return _BAD
    return text[start:end], text[sep], sep + 1


def _scalar_arguments(text: str) -> str:
    """The ``arguments`` of an ARGS that is no object or array (``text``: it
    and the rest of the block): a string's text, ``"{}"`` for an empty one."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return text.rstrip(_SPACE).removesuffix("}").rstrip(_SPACE) or "{}"
    if not value:
        return "{}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
