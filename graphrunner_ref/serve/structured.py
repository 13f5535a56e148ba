"""Structured output on ``graphrunner serve``: a request's grammar from its
``response_format`` (OpenAI's ``json_object`` and ``json_schema``) or its
``structured_outputs`` (vLLM's ``json``, ``regex``, ``choice``, ``grammar``,
``json_object``), compiled by xgrammar on the HTTP side.

:func:`grammar_spec` reads what a body asks (a :class:`GrammarSpec`, or
None); :class:`Grammars` compiles it, in a worker thread, never on the engine
thread, cached per grammar (xgrammar's compiler cache), into a factory of
matchers the engine makes one of per request
(:mod:`graphrunner_ref.engine.grammar`). A grammar xgrammar cannot compile is
a 400 naming the field and xgrammar's message; where the server cannot mask a
step's tokens (no tokenizer, ``--overlap``, ``--steps-per-launch`` above 1,
``--check``) or xgrammar is not installed, a 400 naming the field and why.

JSON schemas compile without free whitespace (``{"a": 1, "b": [2, 3]}``):
a model cannot pad an answer with blanks to its token budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Literal

from graphrunner.util import MissingExtraError, needs_extra
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.grammar import GrammarFactory
from graphrunner_ref.engine.serving import structured_runner
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError, shown
from graphrunner_ref.serve.protocol import ChatRequest, CompletionRequest, Job
from graphrunner_ref.serve.tools import call_grammar

__all__ = ["GrammarSpec", "Grammars", "grammar_spec", "with_grammar"]

#: What a grammar is written in.
Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_call"]
#: vLLM's ``structured_outputs`` keys, each a kind of grammar.
_VLLM_KEYS: dict[str, Kind] = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
#: The most characters of a grammar's text (a schema as JSON, a regex, ...).
MAX_GRAMMAR_CHARS = 1 << 16


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's grammar: its ``kind``, its ``text`` (a JSON schema as
    canonical JSON, a regex, EBNF; for ``choice`` the choices as a JSON
    list; empty for ``json_object``) and the field it came from (``param``,
    what an error names)."""

    kind: Kind
    text: str
    param: str


#: The body fields that may ask for a grammar (besides a forced tool call).
GRAMMAR_FIELDS = frozenset({"response_format", "structured_outputs"})


def grammar_spec(fields: dict[str, Any]) -> GrammarSpec | None:
    """The grammar a request body's ``response_format`` or
    ``structured_outputs`` asks for (``fields``: the body's fields set),
    None for free text; :class:`APIError` 400 naming the field when neither
    names a grammar the server knows or both are given."""
    fmt, vllm = fields.get("response_format"), fields.get("structured_outputs")
    if fmt is not None and vllm is not None:
        raise APIError(
            400,
            "response_format and structured_outputs: both given; expected one of them",
            param="structured_outputs",
        )
    if vllm is not None:
        return _vllm_spec(vllm)
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema" and set(fmt) == {"type", "json_schema"}:
        body = fmt["json_schema"]
        if not isinstance(body, dict) or not set(body) <= {
            "name",
            "schema",
            "strict",
            "description",
        }:
            raise APIError(
                400,
                f"response_format.json_schema={shown(body)}: expected an object with "
                "name, schema, strict and description",
                param="response_format.json_schema",
            )
        schema = body.get("schema", {})  # OpenAI's default: any JSON object
        return _json_spec(schema, "response_format.json_schema.schema")
    raise APIError(
        400,
        f'response_format={shown(fmt)}: expected {{"type": "text"}}, '
        '{"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}',
        param="response_format",
    )


async def with_grammar(grammars: Grammars, body: CompletionRequest | ChatRequest, job: Job) -> Job:
    """``job`` with the grammar ``body`` asks for (an output format, or a
    forced tool call), compiled (off the event loop and the engine thread);
    ``job`` itself for free text."""
    spec = grammar_spec(body.model_dump(exclude_unset=True))
    tools = job.tools
    calls = None if tools is None else call_grammar(tools)
    if tools is not None and calls is not None:
        if spec is not None:
            raise APIError(
                400,
                f"tool_choice={tools.named or tools.choice!r} with {spec.param}: "
                "a forced tool call has its own format; expected one of them",
                param="tool_choice",
            )
        spec = GrammarSpec("tool_call", json.dumps(calls.calls), "tool_choice")
    factory = await grammars.factory(spec)
    return job if factory is None else dataclasses.replace(job, grammar=factory)


def _vllm_spec(vllm: Any) -> GrammarSpec:
    asked = (
        {k: v for k, v in vllm.items() if v not in (None, False)} if isinstance(vllm, dict) else {}
    )
    unknown = [k for k in asked if k not in _VLLM_KEYS]
    if not isinstance(vllm, dict) or unknown or len(asked) != 1:
        why = f"{unknown[0]!r} is not taken" if unknown else f"{len(asked)} grammars given"
        raise APIError(
            400,
            f"structured_outputs={shown(vllm)}: {why}; expected one of {', '.join(_VLLM_KEYS)}",
            param="structured_outputs",
        )
    ((key, value),) = asked.items()
    param, kind = f"structured_outputs.{key}", _VLLM_KEYS[key]
    if kind == "json_schema":
        schema = json.loads(value) if isinstance(value, str) and _is_json(value) else value
        return _json_spec(schema, param)
    if kind == "json_object":
        if value is not True:
            raise APIError(400, f"{param}={value!r}: expected true", param=param)
        return GrammarSpec(kind, "", param)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise APIError(
                400, f"{param}={shown(value)}: expected a list of non-empty texts", param=param
            )
        return GrammarSpec(kind, _checked_text(json.dumps(value), param), param)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}={shown(value)}: expected a non-empty text", param=param)
    return GrammarSpec(kind, _checked_text(value, param), param)


def _json_spec(schema: Any, param: str) -> GrammarSpec:
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{param}={shown(schema)}: expected a JSON schema object", param=param)
    return GrammarSpec("json_schema", _checked_text(json.dumps(schema), param), param)


def _checked_text(text: str, param: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise APIError(
            400,
            f"{param}: {len(text)} characters; expected at most {MAX_GRAMMAR_CHARS}",
            param=param,
        )
    return text


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class Grammars:
    """The served model's grammar compiler, built on first use.

    Args:
        config: the engine's options (whether its step can mask a grammar's
            tokens: :func:`~graphrunner_ref.engine.serving.structured_runner`).
        codec: the checkpoint's tokenizer (xgrammar reads its vocabulary), or None.
        vocab_size: the model's vocabulary (the bitmask's width).
        end_token: the token that ends an answer (the grammar's stop token),
            or None (a grammar then ends where it is complete).
    """

    def __init__(
        self, config: EngineConfig, codec: TextCodec | None, vocab_size: int, end_token: int | None
    ) -> None:
        self.codec, self.vocab_size, self.end_token = codec, vocab_size, end_token
        self.why_not = _why_not(config, codec)
        self._compiler: Any = None
        self._lock = threading.Lock()

    async def factory(self, spec: GrammarSpec | None) -> GrammarFactory | None:
        """``spec`` compiled in a worker thread (the event loop and the
        engine thread go on); None for free text."""
        if spec is None:
            return None
        if self.why_not is not None:
            raise APIError(
                400,
                f"{spec.param}: not supported: {self.why_not}",
                param=spec.param,
                code="unsupported",
            )
        return await asyncio.to_thread(self.compile, spec)

    def compile(self, spec: GrammarSpec) -> GrammarFactory:
        """``spec`` compiled (cached per grammar); a factory of its matchers.
        :class:`APIError` 400 naming ``spec.param`` when xgrammar refuses it
        or is not installed."""
        try:
            with self._lock:
                compiler = self._compiler or self._build()
                compiled = self._compiled(compiler, spec)
        except MissingExtraError as e:
            raise APIError(
                400, f"{spec.param}: {e}", param=spec.param, code="unsupported"
            ) from None
        except (RuntimeError, ValueError) as e:
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
            raise APIError(
                400, f"{spec.param}: xgrammar cannot compile it: {why}", param=spec.param
            ) from None
        import xgrammar

        return functools.partial(
            xgrammar.GrammarMatcher, compiled, terminate_without_stop_token=self.end_token is None
        )

    def _build(self) -> Any:
        with needs_extra("structured", "structured output (response_format, structured_outputs)"):
            import xgrammar
        assert self.codec is not None  # why_not says so otherwise
        stops = [self.end_token] if self.end_token is not None else None
        info = xgrammar.TokenizerInfo.from_huggingface(
            self.codec.tokenizer, vocab_size=self.vocab_size, stop_token_ids=stops
        )
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
        return self._compiler

    @staticmethod
    def _compiled(compiler: Any, spec: GrammarSpec) -> Any:
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.text, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text))
            return compiler.compile_grammar(f"root ::= {choices}")
        if spec.kind == "tool_call":
            return compiler.compile_grammar(_tool_call_grammar(json.loads(spec.text)))
        return compiler.compile_grammar(spec.text)


def _tool_call_grammar(calls: list[list[str]]) -> Any:
    """One ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` of any
    of ``calls`` (``[name, parameters schema as JSON]`` each), its arguments
    following the function's schema."""
    import xgrammar

    def one(name: str, parameters: str) -> Any:
        schema = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": json.loads(parameters)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        body = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        start = xgrammar.Grammar.from_ebnf('root ::= "<tool_call>\\n"')
        end = xgrammar.Grammar.from_ebnf('root ::= "\\n</tool_call>"')
        return xgrammar.Grammar.concat(start, body, end)

    grammars = [one(name, parameters) for name, parameters in calls]
    return grammars[0] if len(grammars) == 1 else xgrammar.Grammar.union(*grammars)


def _why_not(config: EngineConfig, codec: TextCodec | None) -> str | None:
    """Why this server cannot constrain an answer, or None when it can."""
    if codec is None:
        return "the served model has no tokenizer for a grammar to read; expected none"
    if not structured_runner(config):
        flags = [
            name
            for name, on in (
                ("--overlap", config.overlap),
                (f"--steps-per-launch {config.steps_per_launch}", config.steps_per_launch > 1),
                ("--check", config.check),
            )
            if on
        ]
        return (
            f"this server runs with {' and '.join(flags)}, whose step cannot follow a grammar "
            "token by token; expected none (or a server without those flags)"
        )
    return None
