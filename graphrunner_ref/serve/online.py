"""The online engine: one thread owns the model, its pools and the runner and
steps :func:`graphrunner_ref.engine.serving.serve`, the engine path of
``generate`` and ``demo``; the HTTP side only submits, aborts and reads.

:class:`OnlineEngine` is that run's
:class:`~graphrunner_ref.engine.online.RequestSource`. At every step boundary
(:meth:`OnlineEngine.feed`) it hands the HTTP side what the step produced
(each request's new tokens, its end) in one call onto the event loop, moves
submitted requests into the run, and ends the ones to abort: a waiting one
leaves the queue, a running one is cut by the engine's ``stop`` hook after
its next token, and the schedule frees its request row and KV pages as it
frees any finished request. Nothing the HTTP side does touches a pool.

A request is aborted when its client goes (:meth:`OnlineEngine.abort`), its
deadline passes (``--request-timeout``) or the server shuts down past
``--shutdown-timeout`` (:meth:`OnlineEngine.close`). A failing engine run
answers every request in flight with an error and starts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from graphrunner import GraphRunner
from graphrunner.sizing import CaptureReport
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.results import Run, TokenLogprobs
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io.stop import StopStrings
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.metrics import Metrics
from graphrunner_ref.serve.protocol import Job

__all__ = ["Delta", "OnlineEngine", "Ticket"]

log = logging.getLogger("graphrunner.serve")

#: Seconds an idle engine waits before it looks again (arrivals wake it at once).
IDLE_WAIT = 0.5
#: Engine runs that may fail (each answering its requests with an error) before
#: the server stops serving.
MAX_FAILURES = 3
#: What a client told to retry waits, in seconds.
RETRY_AFTER = "1"

#: Why a request was aborted, as its error event says.
DEADLINE = "the request passed its deadline (--request-timeout)"
SHUTDOWN = "the server shut down before the request finished (--shutdown-timeout)"
GONE = "the client went away"


@dataclass(slots=True)
class Delta:
    """What one engine step gave a request: its new ``tokens`` (with their
    ``logprobs`` when asked) and, on its last, how it ended: ``finish``
    (``"stop"`` or ``"length"``), the ``stop`` string that ended it, or the
    ``error`` that aborted it."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: str | None = None
    stop: str | None = None
    error: str | None = None

    @property
    def last(self) -> bool:
        return self.finish is not None or self.error is not None


class Ticket:
    """One request in flight: its :class:`~graphrunner_ref.serve.protocol.Job`,
    the engine's request id, and the queue of :class:`Delta` its HTTP handler
    reads (filled on the event loop only).

    Args:
        rid: the engine's request id.
        job: the validated request.
        deadline: ``time.monotonic()`` past which it is aborted (None: never).
        stops: its stop strings' hook (None: none).
    """

    def __init__(
        self, rid: int, job: Job, deadline: float | None, stops: StopStrings | None
    ) -> None:
        self.rid, self.job, self.deadline, self.stops = rid, job, deadline, stops
        self.events: asyncio.Queue[Delta] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.first: float | None = None  # when the first token reached the event loop
        self.last: float | None = None
        self.sent = 0  # engine thread: tokens handed over
        self.started = False  # event loop: no longer waiting (a token, or the end, came)


OnCapture = Callable[[GraphRunner, CaptureReport], None]


class OnlineEngine:
    """The engine thread and its queues (see the module doc).

    Args:
        config: the engine's options (as ``generate`` maps its flags).
        bundle: the loaded model over its pools.
        codec: the checkpoint's tokenizer (stop strings read through it), or None.
        end_token: the token that ends a request (the tokenizer's EOS), or None.
        max_waiting: requests that may wait for their first token; one more is
            answered 503 with ``Retry-After``.
        request_timeout: seconds a request may take (None: no deadline).
        metrics: where the engine's state and the latencies go.
        on_capture: called on the engine thread once the runner is captured.
    """

    def __init__(
        self,
        config: EngineConfig,
        bundle: ServingBundle,
        *,
        codec: TextCodec | None,
        end_token: int | None,
        max_waiting: int,
        request_timeout: float | None,
        metrics: Metrics,
        on_capture: OnCapture | None = None,
    ) -> None:
        self.config, self.bundle, self.codec, self.end_token = config, bundle, codec, end_token
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self.metrics, self.on_capture = metrics, on_capture
        self.runner: GraphRunner | None = None
        self.ready = threading.Event()  # set once captured (or failed)
        self.stopped = threading.Event()
        self.failure: BaseException | None = None
        self.failures = 0
        self.closing = False
        self.waiting = 0  # event loop: submitted, no token yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_rid = 0
        self._cond = threading.Condition()
        self._inbox: list[Ticket] = []  # guarded by _cond
        self._aborts: dict[int, str] = {}  # guarded by _cond
        self._close_at: float | None = None  # guarded by _cond
        # Engine thread only.
        self._tickets: dict[int, Ticket] = {}
        self._cut: dict[int, str] = {}
        self._fresh: dict[int, list[int]] = {}
        self._finished: list[int] = []
        self._thread = threading.Thread(target=self._main, name="graphrunner-engine", daemon=True)

    # -- the HTTP side (event loop) ------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (it captures, then serves)."""
        self._thread.start()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the tickets' queues live on."""
        self._loop = loop

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and self.failure is None and not self.stopped.is_set()

    def submit(self, job: Job) -> Ticket:
        """Queue ``job``; its :class:`Ticket`. :class:`APIError` 503 (with
        ``Retry-After``) when the server shuts down, has stopped, or
        ``max_waiting`` requests already wait."""
        retry = {"Retry-After": RETRY_AFTER}
        if self.closing or not self.healthy:
            why = "is shutting down" if self.closing else "is not serving"
            raise APIError(503, f"the server {why}; expected a retry elsewhere", headers=retry)
        if self.waiting >= self.max_waiting:
            raise APIError(
                503,
                f"{self.waiting} requests wait for the engine, the most --max-waiting "
                f"{self.max_waiting} allows; expected a retry after {RETRY_AFTER} s",
                code="queue_full",
                headers=retry,
            )
        stops = StopStrings(self.codec, job.stops) if job.stops and self.codec else None
        timeout = self.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        ticket = Ticket(self._next_rid, job, deadline, stops)
        self._next_rid += 1
        self.waiting += 1
        self.metrics.waiting_http(self.waiting)
        with self._cond:
            self._inbox.append(ticket)
            self._cond.notify()
        return ticket

    def abort(self, ticket: Ticket, why: str = GONE) -> None:
        """End ``ticket`` at the next step boundary (any thread)."""
        with self._cond:
            self._aborts[ticket.rid] = why
            self._cond.notify()

    def close(self, timeout: float) -> None:
        """Admit nothing more; requests in flight may finish within
        ``timeout`` seconds, then are aborted with an error. The engine thread
        ends once none is left."""
        self.closing = True
        with self._cond:
            if self._close_at is None:
                self._close_at = time.monotonic() + timeout
            self._cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread; whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _deliver(self, out: list[tuple[Ticket, Delta]]) -> None:
        """On the event loop: each step's deltas into their tickets' queues."""
        now = time.perf_counter()
        for ticket, delta in out:
            if delta.tokens:
                if ticket.first is None:
                    ticket.first = now
                    self.metrics.first_token(now - ticket.submitted, len(ticket.job.prompt))
                else:
                    assert ticket.last is not None
                    self.metrics.next_tokens(now - ticket.last, len(delta.tokens))
                ticket.last = now
                self.metrics.generated(len(delta.tokens))
            if (delta.tokens or delta.last) and not ticket.started:
                ticket.started = True
                self.waiting -= 1
                self.metrics.waiting_http(self.waiting)
            if delta.last:
                self.metrics.finished(delta.error is not None)
            ticket.events.put_nowait(delta)

    # -- the engine thread -----------------------------------------------------------

    def _main(self) -> None:
        try:
            while True:
                try:
                    hooks = serving.Hooks(
                        end_token=self.end_token,
                        on_token=self._on_token,
                        on_finish=self._on_finish,
                        stop=self._stop,
                    )
                    serving.serve(
                        self.config,
                        self.bundle,
                        [],
                        hooks=hooks,
                        on_capture=self._captured,
                        source=self,
                    )
                    return  # closed, and every request answered
                except Exception as e:  # one failing run: its requests answered, the next starts
                    log.exception("graphrunner serve: the engine run failed")
                    self.failures += 1
                    self._fail_all(f"the engine failed ({type(e).__name__}: {e})")
                    if not self.ready.is_set() or self.closing or self.failures >= MAX_FAILURES:
                        self.failure = e
                        return
        finally:
            self.stopped.set()
            self.ready.set()  # nobody waits for a capture that will not come

    def _captured(self, runner: GraphRunner, report: CaptureReport) -> None:
        self.runner = runner
        if self.on_capture is not None and not self.ready.is_set():
            self.on_capture(runner, report)
        self.ready.set()

    def _on_token(self, rid: int, token: int) -> None:
        self._fresh.setdefault(rid, []).append(token)

    def _on_finish(self, rid: int, tokens: list[int]) -> None:
        self._finished.append(rid)

    def _stop(self, rid: int, tokens: list[int]) -> bool:
        if rid in self._cut:
            return True
        ticket = self._tickets.get(rid)
        return ticket is not None and ticket.stops is not None and ticket.stops(rid, tokens)

    def feed(self, run: Run) -> None:
        """The :class:`~graphrunner_ref.engine.online.RequestSource` hook, at
        a step boundary: hand over what the step produced, take arrivals,
        drop or cut aborted requests; wait while idle and open."""
        self._publish(run)
        with self._cond:
            while True:
                self._take(run)
                if run.pending or run.live or run.prefilling or self._close_at is not None:
                    break
                self.metrics.engine_state(self.bundle, self.runner, run)
                self._cond.wait(IDLE_WAIT)
        self.metrics.engine_state(self.bundle, self.runner, run)

    def _take(self, run: Run) -> None:
        """Under the lock: arrivals into ``run.pending``, aborts and deadlines."""
        now = time.monotonic()
        refused: list[tuple[Ticket, Delta]] = []
        for ticket in self._inbox:
            job = ticket.job
            try:  # checked on the HTTP side already: a failure here is one request's alone
                request = Request(
                    ticket.rid, tuple(job.prompt), job.max_tokens, run.clock, job.sampling
                )
            except (TypeError, ValueError) as e:
                refused.append((ticket, Delta([], error=f"the engine refused the request: {e}")))
                continue
            self._tickets[ticket.rid] = ticket
            run.pending.append(request)
        self._inbox.clear()
        if refused:
            self._post(refused)
        gone, self._aborts = self._aborts, {}
        late = self._close_at is not None and now >= self._close_at
        for rid, ticket in self._tickets.items():
            if late:
                gone.setdefault(rid, SHUTDOWN)
            elif ticket.deadline is not None and now >= ticket.deadline:
                gone.setdefault(rid, DEADLINE)
        gone = {rid: why for rid, why in gone.items() if rid in self._tickets}
        if not gone:
            return
        waiting = {r.rid for r in run.pending} & gone.keys()
        if waiting:
            run.pending = deque(r for r in run.pending if r.rid not in waiting)
            self._post([(self._tickets.pop(rid), Delta([], error=gone[rid])) for rid in waiting])
        for rid, why in gone.items():
            if rid not in waiting:
                self._cut.setdefault(rid, why)

    def _publish(self, run: Run) -> None:
        """The last step's tokens and ends, onto the event loop in one call;
        a finished request's output leaves the run (it would grow forever)."""
        out: list[tuple[Ticket, Delta]] = []
        for rid, tokens in self._fresh.items():
            ticket = self._tickets.get(rid)
            if ticket is None:
                continue
            logprobs = []
            if ticket.job.logprobs is not None:
                logprobs = run.logprobs.get(rid, [])[ticket.sent : ticket.sent + len(tokens)]
            ticket.sent += len(tokens)
            out.append((ticket, Delta(tokens, logprobs)))
        self._fresh = {}
        for rid in self._finished:
            out.append(self._ending(run, rid))
        self._finished = []
        if out:
            self._post(out)

    def _ending(self, run: Run, rid: int) -> tuple[Ticket, Delta]:
        ticket = self._tickets.pop(rid)
        why = self._cut.pop(rid, None)
        tokens = run.outputs.pop(rid, [])
        run.finished.discard(rid)
        run.logprobs.pop(rid, None)
        if why is not None:
            return ticket, Delta([], error=why)
        stop = ticket.stops.hits.pop(rid, None) if ticket.stops is not None else None
        ended = self.end_token is not None and bool(tokens) and tokens[-1] == self.end_token
        return ticket, Delta(
            [], finish="stop" if stop is not None or ended else "length", stop=stop
        )

    def _post(self, out: list[tuple[Ticket, Delta]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody listens
            loop.call_soon_threadsafe(self._deliver, out)

    def _fail_all(self, why: str) -> None:
        """After a failed run (which freed its rows and pages): every request
        in flight answered with ``why``."""
        with self._cond:
            inbox, self._inbox = self._inbox, []
        tickets = [*self._tickets.values(), *inbox]
        self._tickets, self._cut, self._fresh, self._finished = {}, {}, {}, []
        self._post([(t, Delta([], error=why)) for t in tickets])
