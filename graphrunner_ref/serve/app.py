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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from graphrunner import __version__
from graphrunner_ref.serve.answer import Answer, TextStream, merged_deltas, streamed
from graphrunner_ref.serve.errors import APIError, install_handlers, validation_error
from graphrunner_ref.serve.metrics import CONTENT_TYPE, Metrics
from graphrunner_ref.serve.online import Delta, OnlineEngine
from graphrunner_ref.serve.protocol import (
    Body,
    ChatRequest,
    CompletionRequest,
    Limits,
    job_of,
)
from graphrunner_ref.serve.structured import GRAMMAR_FIELDS, with_grammar
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
    job = job_of(body, state.limits)
    if job.tools is not None or not GRAMMAR_FIELDS.isdisjoint(body.model_fields_set):
        job = await with_grammar(state.engine.grammars, body, job)
    engine, name, codec = state.engine, state.model_name, state.limits.codec
    tickets = engine.submit(job)
    if job.stream:
        events = streamed(engine, name, codec, tickets, chat)
        return StreamingResponse(events, media_type="text/event-stream")
    answer = Answer(engine, name, codec, tickets, chat)
    deltas = await _collect(request, answer)
    if deltas is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(answer.whole(deltas))


async def _collect(request: Request, answer: Answer) -> list[list[Delta]] | None:
    """Every delta of each choice up to its last; None when the client went
    away first (every choice still running is aborted)."""
    gone = asyncio.ensure_future(_disconnect(request))
    deltas: list[list[Delta]] = [[] for _ in answer.choices]
    merged = merged_deltas(answer.tickets)
    try:
        while True:
            get = asyncio.ensure_future(anext(merged, None))
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                answer.abort_unfinished()
                return None
            item = get.result()
            if item is None:
                return deltas
            i, delta = item
            deltas[i].append(delta)
            if delta.last:
                answer.choices[i].end = delta
            if delta.error is not None:
                return [ds or [delta] for ds in deltas]
    except BaseException:
        answer.abort_unfinished()
        raise
    finally:
        gone.cancel()
        await merged.aclose()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
