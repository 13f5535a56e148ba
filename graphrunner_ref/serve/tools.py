"""Tool calls on ``/v1/chat/completions``, in the Hermes / Qwen format.

A request's ``tools`` (OpenAI's function tools) go to the checkpoint's chat
template, which must declare them (it reads ``tools``); the model answers a
call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which
:func:`parse_tool_calls` turns into OpenAI's ``tool_calls`` (``arguments``
always a JSON string, ``"{}"`` when empty) and the finish reason
``tool_calls``. ``tool_choice``:

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
    "Tools",
    "call_grammar",
    "parse_tool_calls",
    "template_messages",
    "tools_of",
]

#: Tools one request may declare.
MAX_TOOLS = 64
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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
    """The content and OpenAI ``tool_calls`` of an answer's ``text``: each
    ``<tool_call>`` block that holds a JSON object with a ``name`` is a call
    (``arguments`` a JSON string, ``"{}"`` when missing or empty); the text
    outside them is the content (None when nothing is left). A block that
    does not parse leaves the whole text as content, no call."""
    calls = []
    for block in _CALL.findall(text):
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments") or {}
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments
                    if isinstance(arguments, str)
                    else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls
