"""Module moves of one engine step and of one streamed completion.

``sys.setprofile`` records, at each Python call and return, the module of the
innermost frame of the reference engine or server (``graphrunner_ref/engine``,
``graphrunner_ref/serve``); library and third-party frames count as their
caller's. A *move* is a change of that module, a *return* a move to a module
the trace had already left.

- :func:`chunked_prefill_step`: one ``Engine.step()`` that runs prompt chunks
  and a decode step (two prompts of 10 and 39 tokens under a budget of 16
  tokens a step, the embedded model, eager runner; the first step untraced).
- :func:`streamed_completion`: one ``POST /v1/completions`` with
  ``stream: true`` on the embedded model's server (the app driven in-process,
  its engine thread as ``graphrunner serve`` runs it), from the HTTP handler
  to the first chunk that carries a token: the event loop's moves, and the
  engine thread's from the request's arrival to its hand-over of the first
  tokens (``EngineThread._post``), each thread's counted on its own and summed.

``PYTHONPATH=. .venv/bin/python -m bench.trace_modules`` prints both.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.serving import build, open_engine
from graphrunner_ref.engine.workload import Request

_REF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "graphrunner_ref")
ROOTS = tuple(os.path.join(_REF, part) + os.sep for part in ("engine", "serve"))


@dataclass
class Trace:
    """The modules a traced flow passed through, in order, per thread."""

    threads: dict[int, list[str]] = field(default_factory=dict)

    @property
    def moves(self) -> int:
        return sum(max(len(seq) - 1, 0) for seq in self.threads.values())

    @property
    def returns(self) -> int:
        return sum(
            sum(1 for i, m in enumerate(seq) if m in seq[:i]) for seq in self.threads.values()
        )

    @property
    def modules(self) -> set[str]:
        return {m for seq in self.threads.values() for m in seq}

    def entries(self, module: str) -> int:
        """Times the flow entered ``module`` (its first module counts as entered)."""
        return sum(
            sum(1 for i, m in enumerate(seq) if m == module and (i == 0 or seq[i - 1] != m))
            for seq in self.threads.values()
        )

    def summary(self) -> str:
        lines = [f"moves {self.moves}, returns {self.returns}, modules {len(self.modules)}"]
        lines += [" > ".join(seq) for seq in self.threads.values()]
        return "\n".join(lines)


def _module(frame: FrameType | None) -> str | None:
    while frame is not None:
        name = frame.f_code.co_filename
        for root in ROOTS:
            if name.startswith(root):
                return os.path.relpath(name, _REF)
        frame = frame.f_back
    return None


class _Recorder:
    """A profile function that records while :attr:`on` is set; a thread
    stops recording after a call to a function named ``last`` (the engine
    thread's hand-over of its first tokens)."""

    def __init__(self, last: str | None = None) -> None:
        self.on = False
        self.last = last
        self.trace = Trace()
        self._done: set[int] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event not in ("call", "return"):
            return
        thread = threading.get_ident()
        if thread in self._done:
            return
        module = _module(frame if event == "call" else frame.f_back)
        if module is None:
            return
        seq = self.trace.threads.setdefault(thread, [])
        if not seq or seq[-1] != module:
            seq.append(module)
        if event == "call" and frame.f_code.co_name == self.last:
            self._done.add(thread)


def chunked_prefill_step() -> Trace:
    """The modules one chunked-prefill ``Engine.step()`` passes through."""
    config = EngineConfig(
        runner="eager", capture_sizes=(1, 2, 4), quiet=True, max_num_batched_tokens=16
    )
    bundle = build(config, max_requests=4, context=96)
    trace = [Request(0, tuple(range(3, 13)), 4), Request(1, tuple(range(20, 59)), 4)]
    engine = open_engine(config, bundle, trace=trace)
    for r in trace:
        engine.add_request(list(r.prompt), r.max_new_tokens, rid=r.rid + 100)
    engine.step()
    recorder = _Recorder()
    recorder.on = True
    sys.setprofile(recorder)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    engine.close()
    return recorder.trace


def streamed_completion() -> Trace:
    """The modules one streamed completion passes through, from the HTTP
    handler to its first token chunk (event loop and engine thread)."""
    from graphrunner.sampling import SamplingParams
    from graphrunner_ref.serve.app import ServeState, create_app
    from graphrunner_ref.serve.metrics import Metrics
    from graphrunner_ref.serve.online import IDLE_WAIT, OnlineEngine
    from graphrunner_ref.serve.protocol import Limits

    config = EngineConfig(runner="eager", capture_sizes=(1, 2, 4), quiet=True)
    bundle = build(config, max_requests=4, context=96)
    metrics = Metrics()
    engine = OnlineEngine(
        config, bundle, codec=None, end_token=None, max_waiting=8, request_timeout=None,
        metrics=metrics,
    )  # fmt: skip
    limits = Limits(96, bundle.config.vocab_size, 0, SamplingParams(), None)
    app = create_app(ServeState(engine, "embedded", limits, None, metrics, 0))
    recorder = _Recorder(last="_post")
    threading.setprofile(recorder)  # the engine thread records from its start
    try:
        engine.start()
        engine.ready.wait(120)
        time.sleep(2 * IDLE_WAIT)  # the engine thread done building, waiting for work
        body = {"prompt": list(range(3, 13)), "max_tokens": 4, "stream": True}
        asyncio.run(_post(app, engine, recorder, "/v1/completions", body))
    finally:
        threading.setprofile(None)
        engine.close(0)
        engine.join(30)
    return recorder.trace


async def _post(app: Any, engine: Any, recorder: _Recorder, path: str, body: dict) -> None:
    """Drive ``app`` with one request until its first chunk with a token."""
    engine.bind(asyncio.get_running_loop())
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    sent = asyncio.Event()
    done = asyncio.Event()

    async def receive() -> dict:
        if not sent.is_set():
            sent.set()
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and b'"text"' in message.get("body", b""):
            recorder.on = False  # the first chunk with a token: the trace ends
            done.set()

    recorder.on = True
    sys.setprofile(recorder)
    try:
        await app(scope, receive, send)
    finally:
        sys.setprofile(None)
        recorder.on = False


def main() -> int:
    flows: list[tuple[str, Callable[[], Trace]]] = [
        ("one chunked-prefill Engine.step()", chunked_prefill_step),
        ("one streamed completion, handler to first token chunk", streamed_completion),
    ]
    for title, flow in flows:
        trace = flow()
        print(f"{title}: {trace.summary()}")
        if flow is streamed_completion:
            print(f"serve/online.py entered {trace.entries('serve/online.py')} times")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
