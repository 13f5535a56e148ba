"""One request's answer: its ``n`` choices, each one engine request, sent
whole or as server-sent events.

A choice (:class:`Choice`) reads its ticket's deltas into text
(:class:`TextStream`), log-probabilities and an end; the answer
(:class:`Answer`) puts the choices under one id: whole, every choice in index
order and one ``usage`` (the prompt counted once, as vLLM counts it);
streamed, each delta as its own chunk naming its choice's ``index`` (a
choice's role chunk leaves with its first token), then the usage chunk and
``data: [DONE]``. A client that goes away aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from graphrunner_ref.engine.results import TokenLogprobs
from graphrunner_ref.io.stop import cut_at_stop
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError, error_body
from graphrunner_ref.serve.online import DEADLINE, SHUTDOWN, Delta, OnlineEngine, Ticket
from graphrunner_ref.serve.protocol import Job, usage
from graphrunner_ref.serve.tools import ToolCallParser, parse_tool_calls

__all__ = ["Answer", "Choice", "TextStream", "merged_deltas", "status_of", "streamed"]


def status_of(error: str) -> int:
    """The HTTP status of an aborted request's ``error``."""
    return {DEADLINE: 408, SHUTDOWN: 503}.get(error, 500)


async def merged_deltas(tickets: Sequence[Ticket]) -> AsyncGenerator[tuple[int, Delta], None]:
    """Each ticket's deltas as they come, as ``(index in tickets, delta)``,
    until every ticket's last (or the first error)."""
    if len(tickets) == 1:  # one choice: its own queue, no task between
        while True:
            delta = await tickets[0].events.get()
            yield 0, delta
            if delta.last:
                return
    merged: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

    async def forward(i: int, ticket: Ticket) -> None:
        while True:
            delta = await ticket.events.get()
            merged.put_nowait((i, delta))
            if delta.last:
                return

    tasks = [asyncio.ensure_future(forward(i, t)) for i, t in enumerate(tickets)]
    try:
        running = len(tickets)
        while running:
            i, delta = await merged.get()
            running -= delta.last
            yield i, delta
            if delta.error is not None:
                return
    finally:
        for task in tasks:
            task.cancel()


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


class Choice:
    """One choice of an answer: its engine request (``ticket``) read into
    text, log-probabilities and an end.

    Args:
        ticket: the choice's engine request.
        index: its place among the answer's choices.
        codec: the tokenizer (None: token ids only, empty text).
        chat: a chat completion (a ``message`` / ``delta``), else a text one.
    """

    def __init__(self, ticket: Ticket, index: int, codec: TextCodec | None, chat: bool) -> None:
        self.ticket, self.index, self.codec, self.chat = ticket, index, codec, chat
        job = ticket.job
        self.job: Job = job
        self.stream = TextStream(
            codec,
            job.stops,
            include_stop=job.include_stop,
            skip_special=job.skip_special,
            stop_tokens=job.stop_token_ids,
        )
        self.end: Delta | None = None  # its last delta, once it came
        parsed = chat and job.tools is not None and job.tools.parsed
        self.parser = ToolCallParser() if parsed else None  # its streamed tool calls
        self._role_pending = chat  # the chat role leaves with the first token

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        """The choice of a non-streamed answer from all its ``deltas``."""
        end = self.end = deltas[-1]
        tokens = [t for d in deltas for t in d.tokens]
        entries = [e for d in deltas for e in d.logprobs]
        self.stream.add(tokens, last=True)
        text = self.stream.text()
        choice: dict[str, Any] = {"index": self.index}
        finish = end.finish
        if self.chat:
            content, calls = self._calls(text)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = calls
                finish = "tool_calls"
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(tokens, entries)
        choice |= {"finish_reason": finish, "stop_reason": end.stop, "token_ids": tokens}
        return choice

    def _calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The content and tool calls of a chat answer's ``text``."""
        tools = self.job.tools
        if tools is None or not tools.parsed:
            return text, []
        return parse_tool_calls(text)

    def chunks(self, delta: Delta) -> list[dict[str, Any]]:
        """The streamed choice entries of one ``delta`` (none, the role's,
        its text's)."""
        if delta.last:
            self.end = delta
        out = []
        if self._role_pending:
            # With the first token, as vLLM's: a client's time to first chunk
            # is its time to first token.
            self._role_pending = False
            out.append(self._entry({"role": "assistant", "content": ""}, None))
        if self.parser is not None:
            return out + self._with_calls(delta)
        text = self.stream.add(delta.tokens, last=delta.last)
        if text or delta.tokens or delta.last:
            content = {"content": text} if self.chat and (text or not delta.last) else {}
            logprobs = self.logprobs(delta.tokens, delta.logprobs)
            out.append(
                self._entry(
                    content if self.chat else text,
                    logprobs,
                    finish=delta.finish,
                    stop=delta.stop,
                    tokens=delta.tokens,
                )
            )
        return out

    def _with_calls(self, delta: Delta) -> list[dict[str, Any]]:
        """The chunks of a choice that may call tools: its content as it
        comes, and its calls as ``tool_calls`` deltas, the name as soon as it
        is read and the arguments as they are written
        (:class:`~graphrunner_ref.serve.tools.ToolCallParser`: no tag's text
        ever reaches the content). The delta's tokens and log-probabilities
        go with its first chunk, its end with its last (``tool_calls`` once
        a call was made)."""
        assert self.parser is not None
        text = self.stream.add(delta.tokens, last=delta.last)
        bodies = self.parser.feed(text) + (self.parser.finish() if delta.last else [])
        if not bodies and (delta.tokens or delta.last):
            bodies = [{} if delta.last else {"content": ""}]
        finish = "tool_calls" if delta.last and self.parser.calls else delta.finish
        logprobs = self.logprobs(delta.tokens, delta.logprobs)
        last = len(bodies) - 1
        return [
            self._entry(
                body,
                logprobs if k == 0 else None,
                finish=finish if k == last else None,
                stop=delta.stop,
                tokens=delta.tokens if k == 0 else [],
            )
            for k, body in enumerate(bodies)
        ]

    def _entry(
        self,
        content: Any,
        logprobs: Any,
        *,
        finish: str | None = None,
        stop: str | int | None = None,
        tokens: Sequence[int] = (),
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["delta"] = content
        else:
            choice["text"] = content
        choice["logprobs"] = logprobs or None
        choice["finish_reason"] = finish
        if finish is not None:
            choice["stop_reason"] = stop
        if tokens:
            choice["token_ids"] = list(tokens)
        return choice

    def logprobs(self, tokens: list[int], entries: list[TokenLogprobs]) -> Any:
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
        return f"token_id:{token}" if self.codec is None else self.codec.decode([token])


class Answer:
    """One request's answer: its choices under one id, whole or streamed.

    Args:
        engine: where the choices run (aborted there when the client goes).
        model_name: the served model's name, in every body.
        codec: the tokenizer (None: token ids only).
        tickets: one engine request per choice, in index order.
        chat: a chat completion, else a text one.
    """

    def __init__(
        self,
        engine: OnlineEngine,
        model_name: str,
        codec: TextCodec | None,
        tickets: Sequence[Ticket],
        chat: bool,
    ) -> None:
        self.engine, self.model_name, self.chat = engine, model_name, chat
        self.choices = [Choice(t, i, codec, chat) for i, t in enumerate(tickets)]
        self.job = tickets[0].job
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    @property
    def tickets(self) -> list[Ticket]:
        return [c.ticket for c in self.choices]

    def abort_unfinished(self) -> None:
        """Abort every choice whose end has not come."""
        for choice in self.choices:
            if choice.end is None:
                self.engine.abort(choice.ticket)

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def _usage(self) -> dict[str, Any]:
        """The prompt counted once, every choice's tokens; its cached tokens
        those every choice found in the prefix cache."""
        ends = [c.end for c in self.choices if c.end is not None]
        completion = sum(len(c.stream.tokens) for c in self.choices)
        cached = min((e.cached_tokens for e in ends), default=0)
        return dict(usage(len(self.job.prompt), completion, cached))

    def whole(self, deltas: Sequence[list[Delta]]) -> dict[str, Any]:
        """The non-streamed answer from each choice's deltas (:class:`APIError`
        for an aborted one)."""
        for ds in deltas:
            if ds[-1].error is not None:
                raise APIError(status_of(ds[-1].error), ds[-1].error, code="aborted")
        choices = [c.whole(ds) for c, ds in zip(self.choices, deltas, strict=True)]
        return {**self._head(False), "choices": choices, "usage": self._usage()}

    async def events(self) -> AsyncGenerator[str, None]:
        """The server-sent events of a streamed answer; every choice still
        running is aborted if the client goes away before the end."""
        failed = False
        try:
            async for i, delta in merged_deltas(self.tickets):
                if delta.error is not None:
                    self.choices[i].end = delta
                    body = error_body(delta.error, status_of(delta.error), code="aborted")
                    yield f"data: {json.dumps(body)}\n\n"
                    failed = True
                    break
                for entry in self.choices[i].chunks(delta):
                    yield self._chunk(entry)
            if not failed and self.job.include_usage:
                body = {**self._head(True), "choices": [], "usage": self._usage()}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.abort_unfinished()

    def _chunk(self, entry: dict[str, Any]) -> str:
        body = {**self._head(True), "choices": [entry]}
        if self.job.include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"


async def streamed(
    engine: OnlineEngine,
    model_name: str,
    codec: TextCodec | None,
    tickets: Sequence[Ticket],
    chat: bool,
) -> AsyncIterator[str]:
    """The server-sent events of the :class:`Answer` over ``tickets`` (the
    arguments are its own), the answer made when the stream starts. Closed
    early (the client went), it closes the answer's events at once, which
    aborts every choice still running."""
    answer = Answer(engine, model_name, codec, tickets, chat)
    async with contextlib.aclosing(answer.events()) as events:
        async for event in events:
            yield event
