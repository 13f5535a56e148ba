"""The HTTP side: FastAPI routes in OpenAI's shapes over an
:class:`~graphrunner_ref.serve.online.OnlineEngine`.

``GET /v1/models``, ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (bearer check with ``--api-key``), vLLM's ``POST
/tokenize``, ``POST /detokenize`` (:mod:`~graphrunner_ref.serve.tokenize`) and
``GET /version``, ``GET /health`` (200 once captured and serving) and ``GET
/metrics``. A handler parses and
checks the body (:mod:`~graphrunner_ref.serve.protocol`), submits it, and
answers whole or as server-sent events (``stream``: the chat role first,
text deltas, ``finish_reason`` on the last choice chunk, a usage chunk with
``stream_options.include_usage``, then ``data: [DONE]``). A client that goes
away is aborted at the engine's next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from graphrunner import __version__
from graphrunner_ref.engine.results import TokenLogprobs
from graphrunner_ref.io.stop import cut_at_stop
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError, error_body, install_handlers, validation_error
from graphrunner_ref.serve.metrics import CONTENT_TYPE, Metrics
from graphrunner_ref.serve.online import DEADLINE, SHUTDOWN, Delta, OnlineEngine, Ticket
from graphrunner_ref.serve.protocol import (
    Body,
    ChatRequest,
    CompletionRequest,
    Job,
    Limits,
    job_of,
    usage,
)
from graphrunner_ref.serve.structured import with_grammar
from graphrunner_ref.serve.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

__all__ = ["ServeState", "TextStream", "create_app"]

#: The largest request body read, in bytes.
MAX_BODY = 8 << 20


@dataclass(frozen=True, slots=True)
class ServeState:
    """What the routes read: the engine, the served model's name and limits,
    the API key (None: no check) and the metrics."""

    engine: OnlineEngine
    model_name: str
    limits: Limits
    api_key: str | None
    metrics: Metrics
    created: int


class TextStream:
    """The text of a growing answer, handed out as deltas whose join is the
    whole answer's text: an incomplete character, and what may be the start
    of a stop string, are held back until more follows.

    Args:
        codec: the tokenizer (None: no text, every delta empty).
        stops: the request's stop strings (the text ends before the first).
        include_stop: the text ends after the first stop string instead
            (vLLM's ``include_stop_str_in_output``).
        skip_special: special tokens are left out of the text (vLLM's
            ``skip_special_tokens``).
        stop_tokens: the request's stop token ids: one that ends the answer
            is left out of the text unless ``include_stop`` (as vLLM does).
    """

    def __init__(
        self,
        codec: TextCodec | None,
        stops: Sequence[str],
        *,
        include_stop: bool = False,
        skip_special: bool = True,
        stop_tokens: Sequence[int] = (),
    ) -> None:
        self.codec, self.stops = codec, list(stops)
        self.include_stop, self.skip_special = include_stop, skip_special
        # A stop token is only ever an answer's last: while it trails, it ended it.
        self.stop_tokens = frozenset(() if include_stop else stop_tokens)
        self.tokens: list[int] = []
        self.sent = ""
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def _cut(self, codec: TextCodec) -> tuple[str, str | None]:
        ids = self.tokens
        if ids and ids[-1] in self.stop_tokens:
            ids = ids[:-1]
        decoded = codec.decode(ids, skip_special_tokens=self.skip_special)
        text, stop = cut_at_stop(decoded, self.stops)
        return (text + stop if stop is not None and self.include_stop else text), stop

    def text(self) -> str:
        """The answer so far, cut at its first stop string."""
        if self.codec is None:
            return ""
        return self._cut(self.codec)[0]

    def add(self, tokens: Sequence[int], *, last: bool = False) -> str:
        """The new text ``tokens`` make (``last``: the answer's end: all of it)."""
        self.tokens += tokens
        if self.codec is None:
            return ""
        text, stop = self._cut(self.codec)
        if not last:
            if stop is None and self._hold:
                text = text[: -self._hold]
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):  # a later token re-read an earlier one
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new


def create_app(state: ServeState) -> FastAPI:
    """The server's routes over ``state``."""
    app = FastAPI(title="graphrunner serve", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    engine, metrics = state.engine, state.metrics

    @app.get("/health")
    async def health() -> Response:
        if engine.closing or not engine.healthy:
            why = "shutting down" if engine.closing else "not serving"
            return APIError(503, f"the server is {why}").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _authorize(state, request)
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "graphrunner",
            "max_model_len": state.limits.context,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(state, request)
        body = _parse(CompletionRequest, await _json(request))
        return await _answer(state, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _authorize(state, request)
        body = _parse(ChatRequest, await _json(request))
        return await _answer(state, request, body, chat=True)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await _utility(state, request, TokenizeRequest, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await _utility(state, request, DetokenizeRequest, detokenize)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    return app


async def _utility(
    state: ServeState,
    request: Request,
    body_type: type[Body],
    answer: Callable[[Any, Limits], dict[str, Any]],
) -> Response:
    """A utility route: the key, the body, the model's name, then ``answer``."""
    _authorize(state, request)
    body = _parse(body_type, await _json(request))
    _check_model(state, body.model)
    return JSONResponse(answer(body, state.limits))


def _authorize(state: ServeState, request: Request) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization")
    if given is None:
        raise APIError(
            401,
            "Authorization: missing; expected the header 'Authorization: Bearer KEY' "
            "(the server's --api-key)",
            code="invalid_api_key",
        )
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        key.strip().encode(), state.api_key.encode()
    ):
        raise APIError(
            401,
            "Authorization: a wrong API key; expected 'Bearer KEY' with the server's --api-key",
            code="invalid_api_key",
        )


async def _json(request: Request) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise APIError(413, f"request body: {len(raw)} bytes; expected at most {MAX_BODY}")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise APIError(
            400,
            f"request body: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            "expected a JSON object",
            code="invalid_json",
        ) from None
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body: not valid JSON ({type(e).__name__})") from None


def _parse(model: type[Body], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError(400, f"request body: a JSON {type(data).__name__}; expected a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e.errors()) from None


def _check_model(state: ServeState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"model={model!r}: not served here; expected {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


async def _answer(
    state: ServeState, request: Request, body: CompletionRequest | ChatRequest, *, chat: bool
) -> Response:
    _check_model(state, body.model)
    job = await with_grammar(state.engine.grammars, body, job_of(body, state.limits))
    ticket = state.engine.submit(job)
    answer = _Answer(state, ticket, chat)
    if job.stream:
        return StreamingResponse(answer.events(), media_type="text/event-stream")
    deltas = await _collect(state.engine, request, ticket)
    if deltas is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(answer.whole(deltas))


async def _collect(engine: OnlineEngine, request: Request, ticket: Ticket) -> list[Delta] | None:
    """Every delta of ``ticket`` up to its last; None when the client went
    away first (the request is aborted)."""
    gone = asyncio.ensure_future(_disconnect(request))
    deltas: list[Delta] = []
    try:
        while True:
            get = asyncio.ensure_future(ticket.events.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                engine.abort(ticket)
                return None
            deltas.append(get.result())
            if deltas[-1].last:
                return deltas
    except BaseException:
        engine.abort(ticket)
        raise
    finally:
        gone.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _status_of(error: str) -> int:
    return {DEADLINE: 408, SHUTDOWN: 503}.get(error, 500)


class _Answer:
    """One request's answer, whole or as server-sent events."""

    def __init__(self, state: ServeState, ticket: Ticket, chat: bool) -> None:
        self.state, self.ticket, self.chat = state, ticket, chat
        self.job: Job = ticket.job
        prefix = "chatcmpl" if chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        job = self.job
        self.stream = TextStream(
            state.limits.codec,
            job.stops,
            include_stop=job.include_stop,
            skip_special=job.skip_special,
            stop_tokens=job.stop_token_ids,
        )

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model_name,
        }

    def _usage(self, end: Delta) -> dict[str, Any]:
        return dict(usage(len(self.job.prompt), len(self.stream.tokens), end.cached_tokens))

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        """The non-streamed answer (:class:`APIError` for an aborted one)."""
        end = deltas[-1]
        if end.error is not None:
            raise APIError(_status_of(end.error), end.error, code="aborted")
        tokens = [t for d in deltas for t in d.tokens]
        entries = [e for d in deltas for e in d.logprobs]
        self.stream.add(tokens, last=True)
        text = self.stream.text()
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(tokens, entries)
        choice |= {"finish_reason": end.finish, "stop_reason": end.stop, "token_ids": tokens}
        return {**self._head(False), "choices": [choice], "usage": self._usage(end)}

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer; the request is aborted
        if the client goes away before its end."""
        done = False
        # The chat role goes out with the first token, as vLLM's does, so a
        # client's time to first chunk is its time to first token.
        role_pending = self.chat
        try:
            while not done:
                delta = await self.ticket.events.get()
                done = delta.last
                if delta.error is not None:
                    body = error_body(delta.error, _status_of(delta.error), code="aborted")
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                if role_pending:
                    role_pending = False
                    yield self._chunk({"role": "assistant", "content": ""}, None, None, [])
                text = self.stream.add(delta.tokens, last=done)
                if text or delta.tokens or done:
                    content = {"content": text} if self.chat and (text or not done) else {}
                    logprobs = self._logprobs(delta.tokens, delta.logprobs)
                    yield self._chunk(content if self.chat else text, delta.finish, delta, logprobs)
            if done and self.job.include_usage and delta.error is None:
                body = {**self._head(True), "choices": [], "usage": self._usage(delta)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self.state.engine.abort(self.ticket)

    def _chunk(self, content: Any, finish: str | None, delta: Delta | None, logprobs: Any) -> str:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = content
        else:
            choice["text"] = content
        choice["logprobs"] = logprobs or None
        choice["finish_reason"] = finish
        if finish is not None and delta is not None:
            choice["stop_reason"] = delta.stop
        if delta is not None and delta.tokens:
            choice["token_ids"] = delta.tokens
        body = {**self._head(True), "choices": [choice]}
        if self.job.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    def _logprobs(self, tokens: list[int], entries: list[TokenLogprobs]) -> Any:
        """OpenAI's log-probabilities of ``tokens`` (None when not asked)."""
        n = self.job.logprobs
        if n is None or not entries:
            return None
        name = self._token_text
        if self.chat:
            content = [
                {
                    "token": name(t),
                    "logprob": lp,
                    "bytes": list(name(t).encode()),
                    "top_logprobs": [
                        {"token": name(i), "logprob": v, "bytes": list(name(i).encode())}
                        for i, v in top[:n]
                    ],
                }
                for t, (lp, top) in zip(tokens, entries, strict=False)
            ]
            return {"content": content}
        return {
            "tokens": [name(t) for t in tokens],
            "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{name(i): v for i, v in top[:n]} for _, top in entries],
        }

    def _token_text(self, token: int) -> str:
        codec = self.state.limits.codec
        return f"token_id:{token}" if codec is None else codec.decode([token])
