"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``
(pydantic models, strict: a string is not a number, an unknown field is
refused by name) and what the engine makes of them: :class:`Job`.

Types and ranges are pydantic's to check; what depends on the served model
(the context, the vocabulary, a tokenizer, the log-probabilities the runner
collects) is :func:`job_of`'s. Fields OpenAI has and graphrunner does not
serve (``best_of``, ``functions``, ...) are refused by name when set to
anything but their neutral value.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from graphrunner.sampling import MAX_HOLD_TOKENS, SamplingParams
from graphrunner_ref.engine.grammar import GrammarFactory
from graphrunner_ref.io.text import NoTokenizerError, TextCodec
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.tools import Tools, template_messages, tools_of

__all__ = [
    "MAX_CHOICES",
    "MAX_STOPS",
    "Body",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "Job",
    "Limits",
    "StreamOptions",
    "chat_prompt",
    "job_of",
    "usage",
]

#: Stop strings a request may give (OpenAI's bound).
MAX_STOPS = 4
#: Choices one request may ask for (``n``, parallel sampling).
MAX_CHOICES = 16
#: Characters a stop string may hold.
MAX_STOP_CHARS = 256


class Body(BaseModel):
    """A strict request body: a string is not a number, an unknown field is
    refused by name."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    include_usage: bool = False


class _Common(Body):
    """The fields both endpoints take."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Any = None  # a text or a list of texts (checked by job_of)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's sampling extensions, with vLLM's defaults.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(default=0, ge=0)
    # vLLM's text fields, with vLLM's defaults.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Penalties and logit bias (OpenAI's, and vLLM's repetition_penalty).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output (serve/structured.py): OpenAI's and vLLM's.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Parallel sampling: n choices of one prompt (checked by job_of).
    n: int | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a text or a list of token ids
    (a list of one of either is taken too); ``logprobs`` the top N."""

    prompt: Any = None
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(Body):
    """One part of a message's content: only text."""

    type: Literal["text"]
    text: str


class ChatMessage(Body):
    """One message of a conversation: an assistant's may hold its earlier
    ``tool_calls`` (and no content), a ``tool`` message a call's result for
    ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one text (parts joined; none: empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def turn(self) -> dict[str, Any]:
        """The message as a chat template reads it."""
        turn: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            turn["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            turn["name"] = self.name
        return turn


class ChatRequest(_Common):
    """``POST /v1/chat/completions``: ``messages`` through the checkpoint's
    chat template; ``logprobs`` (a bool) with ``top_logprobs`` N."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None


#: Fields refused unless neutral: the name, whether a value is neutral, why.
_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("best_of", lambda v: v in (None, 1), "no choices drawn beyond n; expected 1"),
    ("echo", lambda v: not v, "the prompt is not echoed; expected false"),
    ("suffix", lambda v: v is None, "no insertion; expected none"),
    (
        "spaces_between_special_tokens",
        lambda v: v,
        "special tokens are joined as the tokenizer decodes them; expected true",
    ),
    ("functions", lambda v: not v, "no function calls; expected none"),
    ("function_call", lambda v: v in (None, "none", "auto"), "no function calls; expected none"),
)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model allows: its context (prompt plus new tokens),
    its vocabulary, the top log-probabilities the runner collects (0: none),
    the default sampling of a request that sets none (the flags'), its
    tokenizer (None: token ids only), and whether a request may ignore the
    end token (not where the runner ends rows inside a launch), and whether
    its step applies penalties, logit bias and ``min_tokens``."""

    context: int
    vocab_size: int
    max_logprobs: int
    sampling: SamplingParams
    codec: TextCodec | None
    ignore_eos: bool = True
    penalties: bool = True


@dataclass(frozen=True, slots=True)
class Job:
    """A validated request, as the engine takes it: prompt token ids, the
    most new tokens, sampling, stop strings, the top log-probabilities
    (None: none asked) and whether it streams (with a usage chunk); and how
    its text reads: the stop string that ended it kept (``include_stop``),
    special tokens left out (``skip_special``); and vLLM's ``ignore_eos``,
    ``stop_token_ids`` and ``min_tokens``; and its grammar (structured
    output: a factory of matchers, compiled by
    :class:`~graphrunner_ref.serve.structured.Grammars` after
    :func:`job_of`), or None."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    logprobs: int | None
    stream: bool
    include_usage: bool
    include_stop: bool = False
    skip_special: bool = True
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    grammar: GrammarFactory | None = None
    n: int = 1
    tools: Tools | None = None


def job_of(body: CompletionRequest | ChatRequest, limits: Limits) -> Job:
    """``body`` checked against the served model and made a :class:`Job`;
    :class:`APIError` (400) naming the field, the value and what was expected."""
    fields = body.model_dump(exclude_unset=True)
    for name, neutral, why in _UNSUPPORTED:
        if name in fields and not neutral(fields[name]):
            raise APIError(
                400,
                f"{name}={fields[name]!r}: not supported: {why}",
                param=name,
                code="unsupported",
            )
    tools = None
    if isinstance(body, ChatRequest):
        tools = tools_of(body.tools, body.tool_choice, limits.codec)
        prompt = chat_prompt(body.messages, limits, tools)
        logprobs = _chat_logprobs(body, limits)
        max_tokens = body.max_completion_tokens or body.max_tokens
        default_new = limits.context - len(prompt) + 1
    else:
        prompt = _completion_prompt(body.prompt, limits)
        logprobs = _logprobs("logprobs", body.logprobs, limits)
        max_tokens = body.max_tokens
        default_new = 16  # OpenAI's default for completions
    room = limits.context - len(prompt) + 1
    if room < 1:
        raise APIError(
            400,
            f"prompt: {len(prompt)} tokens; expected at most {limits.context} (the server's "
            "context, --max-context-len)",
            param="messages" if isinstance(body, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_new, room)
    elif max_tokens > room:
        which = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else ""
        name = which or "max_tokens"
        raise APIError(
            400,
            f"{name}={max_tokens}: the prompt's {len(prompt)} tokens plus {max_tokens} new "
            f"ones need a context of {len(prompt) + max_tokens - 1}; expected 1..{room} "
            f"(the server's context is {limits.context})",
            param=name,
            code="context_length_exceeded",
        )
    if body.ignore_eos and not limits.ignore_eos:
        raise APIError(
            400,
            "ignore_eos=True: not supported: this server's launches of several steps end "
            "every answer at the end token (--steps-per-launch); expected false",
            param="ignore_eos",
            code="unsupported",
        )
    _check_min_tokens(body, max_tokens, limits)
    options = body.stream_options
    if options is not None and not body.stream:
        raise APIError(
            400, "stream_options: given with stream false; expected stream true", param="stream"
        )
    return Job(
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=_sampling(body, limits),
        stops=_stops(body.stop, limits),
        logprobs=logprobs,
        stream=body.stream,
        include_usage=bool(options and options.include_usage),
        include_stop=body.include_stop_str_in_output,
        skip_special=body.skip_special_tokens,
        ignore_eos=body.ignore_eos,
        stop_token_ids=_stop_token_ids(body.stop_token_ids, limits),
        min_tokens=body.min_tokens,
        n=_choices(body.n),
        tools=tools,
    )


def _choices(n: int | None) -> int:
    """``n`` (parallel sampling) checked: 1..:data:`MAX_CHOICES`."""
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"n={n!r}: expected an int in 1..{MAX_CHOICES}", param="n")
    return n


def _check_min_tokens(
    body: CompletionRequest | ChatRequest, max_tokens: int, limits: Limits
) -> None:
    """vLLM's ``min_tokens``: at most the answer's token budget, and only
    where the step holds end tokens back (it does so with the penalties)."""
    n = body.min_tokens
    if n > max_tokens:
        raise APIError(
            400,
            f"min_tokens={n}: more than the answer's {max_tokens} new tokens; expected "
            f"0..{max_tokens}",
            param="min_tokens",
        )
    if n and not limits.penalties:
        raise APIError(
            400,
            f"min_tokens={n}: not supported: this server's step holds no end token back "
            "(--check); expected 0",
            param="min_tokens",
            code="unsupported",
        )
    if n and len(set(body.stop_token_ids or ())) >= MAX_HOLD_TOKENS:
        raise APIError(
            400,
            f"min_tokens={n} with {len(set(body.stop_token_ids or ()))} stop_token_ids: "
            f"expected at most {MAX_HOLD_TOKENS - 1} stop_token_ids with min_tokens",
            param="stop_token_ids",
        )


def _stop_token_ids(ids: list[int] | None, limits: Limits) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``, each a token of the served vocabulary."""
    for i, token in enumerate(ids or ()):
        if not 0 <= token < limits.vocab_size:
            raise APIError(
                400,
                f"stop_token_ids[{i}]={token}: expected a token id in 0..{limits.vocab_size - 1}",
                param="stop_token_ids",
            )
    return tuple(ids or ())


def _completion_prompt(prompt: Any, limits: Limits) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, 'prompt="": empty; expected a text or token ids', param="prompt")
        ids = _encode(limits, prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(
            400,
            f"prompt: a batch of {len(prompt)} prompts; expected one prompt per request",
            param="prompt",
        )
    else:
        shown = "missing" if prompt is None else f"{str(prompt)[:40]!r}"
        raise APIError(
            400,
            f"prompt: {shown}; expected a text or a non-empty list of token ids",
            param="prompt",
        )
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise APIError(
            400,
            f"prompt: token id {bad[0]}; expected ids in 0..{limits.vocab_size - 1}",
            param="prompt",
        )
    return ids


def _encode(limits: Limits, text: str, field: str) -> list[int]:
    if limits.codec is None:
        raise APIError(
            400,
            f"{field}: text, but the served model has no tokenizer; expected token ids "
            "(a list of ints)",
            param=field,
        )
    ids = limits.codec.encode(text)
    if not ids:
        raise APIError(400, f"{field}: encodes to no tokens; expected some text", param=field)
    return ids


def chat_prompt(
    messages: list[ChatMessage], limits: Limits, tools: Tools | None = None
) -> list[int]:
    """The ids of ``messages`` through the checkpoint's chat template, with
    the generation prompt (and ``tools``, the request's function tools);
    :class:`APIError` (400) naming ``messages``."""
    if not messages:
        raise APIError(400, "messages=[]: empty; expected at least one message", param="messages")
    if limits.codec is None:
        raise APIError(
            400,
            "messages: the served model has no tokenizer or chat template; expected "
            "/v1/completions with token ids",
            param="messages",
        )
    turns = template_messages([m.turn() for m in messages])
    functions = None if tools is None else list(tools.functions)
    try:
        ids = limits.codec.chat_messages(turns, what="messages", tools=functions)
    except NoTokenizerError as e:
        raise APIError(400, str(e), param="messages") from None
    if not ids:
        raise APIError(400, "messages: render to no tokens; expected some text", param="messages")
    return ids


def _logprobs(name: str, n: int | None, limits: Limits) -> int | None:
    if n is None:
        return None
    if limits.max_logprobs == 0:
        raise APIError(
            400,
            f"{name}={n}: the server collects no log-probabilities; start it with --logprobs N",
            param=name,
        )
    if n > limits.max_logprobs:
        raise APIError(
            400,
            f"{name}={n}: expected 0..{limits.max_logprobs} (the server collects the top "
            f"{limits.max_logprobs}; start it with --logprobs N for more)",
            param=name,
        )
    return n


def _chat_logprobs(body: ChatRequest, limits: Limits) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400,
            f"top_logprobs={body.top_logprobs}: given without logprobs; expected logprobs true",
            param="top_logprobs",
        )
    if not body.logprobs:
        return None
    if limits.max_logprobs == 0:
        raise APIError(
            400,
            "logprobs=true: the server collects no log-probabilities; start it with --logprobs N",
            param="logprobs",
        )
    return _logprobs("top_logprobs", body.top_logprobs or 0, limits)


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed")
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _sampling(body: CompletionRequest | ChatRequest, limits: Limits) -> SamplingParams:
    given: dict[str, Any] = {}
    for name in (*_SAMPLING, *_PENALTIES):
        value = getattr(body, name)
        if value is not None:
            given[name] = value
    if given.get("top_k") == -1:
        given["top_k"] = 0  # vLLM's spelling of "no limit"
    if body.logit_bias:
        given["logit_bias"] = _logit_bias(body.logit_bias, limits.vocab_size)
    try:
        params = dataclasses.replace(limits.sampling, **given)
    except ValueError as e:
        name = re.split(r"[=:\[ ]", str(e), maxsplit=1)[0]
        raise APIError(400, str(e), param=name) from None
    if params.penalized and not limits.penalties:
        name = next(n for n in (*_PENALTIES, "logit_bias") if n in given)
        raise APIError(
            400,
            f"{name}={given[name]!r}: not supported: this server's step applies no penalties "
            "(--check); expected the neutral value",
            param=name,
            code="unsupported",
        )
    return params


def _logit_bias(bias: dict[str, float], vocab: int) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings) as ``{token id: bias}``,
    each id in the served vocabulary."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab:
            raise APIError(
                400,
                f"logit_bias: key {key!r}; expected a token id in 0..{vocab - 1}",
                param="logit_bias",
            )
        out[token] = value
    return out


def _stops(stop: Any, limits: Limits) -> tuple[str, ...]:
    if stop is None:
        return ()
    if not (
        isinstance(stop, str) or isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise APIError(
            400,
            f"stop={str(stop)[:40]}: expected a text or a list of up to {MAX_STOPS} texts",
            param="stop",
        )
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOPS:
        raise APIError(
            400, f"stop: {len(stops)} strings; expected at most {MAX_STOPS}", param="stop"
        )
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise APIError(
                400,
                f"stop={s[:40]!r}: expected a text of 1..{MAX_STOP_CHARS} characters",
                param="stop",
            )
    if stops and limits.codec is None:
        raise APIError(
            400,
            f"stop={stops[0]!r}: the served model has no tokenizer to read answers as text; "
            "expected no stop strings",
            param="stop",
        )
    return tuple(stops)


def usage(prompt: int, completion: int, cached: int = 0) -> Mapping[str, Any]:
    """OpenAI's ``usage`` object: ``cached`` of the ``prompt`` tokens came
    from the prefix cache (``prompt_tokens_details.cached_tokens``)."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
