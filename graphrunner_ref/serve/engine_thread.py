"""The engine thread: the one thread that owns the model, its pools and the
:class:`~graphrunner_ref.engine.loop.Engine` (built by
:func:`graphrunner_ref.engine.serving.open_engine`, as ``generate`` and
``demo`` build theirs).

It is a short loop, vLLM's engine-core busy loop: take what the HTTP side
queued in the :class:`Inbox` (:meth:`Engine.add_request
<graphrunner_ref.engine.loop.Engine.add_request>` for each submitted
request, :meth:`Engine.abort <graphrunner_ref.engine.loop.Engine.abort>` for
each one to end), call :meth:`Engine.step
<graphrunner_ref.engine.loop.Engine.step>`, and post its outputs (each
request's new tokens, its end, as :class:`Delta`) to the event loop in one
call. Idle, it waits on the inbox. The HTTP side
(:mod:`~graphrunner_ref.serve.online`) never touches the engine or a pool.

A request is aborted when its client goes, its deadline passes
(``--request-timeout``) or the server shuts down past
``--shutdown-timeout``. A failing engine step answers every request in
flight with an error, frees them all, and serving goes on (the thread ends
after ``MAX_FAILURES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from graphrunner import GraphRunner
from graphrunner.sizing import CaptureReport
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.loop import Engine
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.results import RequestOutput, TokenLogprobs
from graphrunner_ref.io.stop import StopStrings
from graphrunner_ref.serve.protocol import Job

__all__ = ["DEADLINE", "GONE", "SHUTDOWN", "Delta", "EngineThread", "Inbox", "Ticket"]

log = logging.getLogger("graphrunner.serve")

#: Seconds an idle engine waits before it looks again (arrivals wake it at once).
IDLE_WAIT = 0.5
#: Engine steps that may fail (each answering its requests with an error)
#: before the thread stops serving.
MAX_FAILURES = 3

#: Why a request was aborted, as its error event says.
DEADLINE = "the request passed its deadline (--request-timeout)"
SHUTDOWN = "the server shut down before the request finished (--shutdown-timeout)"
GONE = "the client went away"


@dataclass(slots=True)
class Delta:
    """What one engine step gave a request: its new ``tokens`` (with their
    ``logprobs`` when asked) and, on its ``last``, how it ended: ``finish``
    (``"stop"`` or ``"length"``), the ``stop`` string or stop token id that
    ended it, or the ``error`` that aborted it. Built on the engine thread,
    read on the event loop: plain fields only."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: str | None = None
    stop: str | int | None = None
    error: str | None = None
    cached_tokens: int = 0  # on the last: its prompt tokens the prefix cache held
    last: bool = False

    @classmethod
    def failed(cls, error: str) -> Delta:
        """The last delta of a request aborted with ``error``."""
        return cls([], error=error, last=True)


@dataclass(eq=False)
class Ticket:
    """One request in flight, shared by both sides: its
    :class:`~graphrunner_ref.serve.protocol.Job`, the engine's request id
    ``rid``, the ``deadline`` (``time.monotonic()``) past which it is aborted
    (None: never), its ``stops`` strings' hook (None: none), and the queue of
    :class:`Delta` its HTTP handler reads (``events``); the rest is the event
    loop's: when it was submitted, when its first and last tokens reached
    the event loop, and whether it still waits for the first."""

    rid: int
    job: Job
    deadline: float | None
    stops: StopStrings | None
    events: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    started: bool = False  # no longer waiting (a token, or the end, came)


Deliveries = list[tuple[Ticket, Delta]]


@dataclass
class Inbox:
    """What the HTTP side hands the engine thread, guarded by ``cond``
    (notified on each change): the ``tickets`` to add, the ``aborts``
    (request id: why), and when the shutdown's grace ends (``close_at``,
    ``time.monotonic()``; None: open)."""

    cond: threading.Condition = field(default_factory=threading.Condition)
    tickets: list[Ticket] = field(default_factory=list)
    aborts: dict[int, str] = field(default_factory=dict)
    close_at: float | None = None


class EngineThread:
    """The engine thread (see the module doc).

    Args:
        config: the engine's options (as ``generate`` maps its flags).
        bundle: the loaded model over its pools.
        inbox: what the HTTP side queues.
        end_token: the token that ends a request (the tokenizer's EOS), or None.
        on_capture: called on this thread once the runner is first captured.
        progress: show the capture's progress bars on stderr.

    ``deliver`` and ``loop`` are set by the HTTP side: each step's deltas
    are posted to ``deliver`` on ``loop`` (nothing is posted without one).
    """

    def __init__(
        self,
        config: EngineConfig,
        bundle: ServingBundle,
        inbox: Inbox,
        *,
        end_token: int | None,
        on_capture: Callable[[GraphRunner, CaptureReport], None] | None = None,
        progress: bool = False,
    ) -> None:
        self.config, self.bundle, self.inbox = config, bundle, inbox
        self.end_token, self.on_capture, self.progress = end_token, on_capture, progress
        self.loop: asyncio.AbstractEventLoop | None = None
        self.deliver: Callable[[Deliveries], None] | None = None
        self.engine: Engine | None = None  # read by /metrics (counts only)
        self.runner: GraphRunner | None = None  # the decode runner, once captured
        self.ready = threading.Event()  # set once every runner is captured (or it failed)
        self.stopped = threading.Event()
        self.failure: BaseException | None = None
        self.failures = 0
        self._tickets: dict[int, Ticket] = {}  # in the engine, by request id
        self._cut: dict[int, str] = {}  # aborted in the engine: why
        self._thread = threading.Thread(target=self._main, name="graphrunner-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread; whether it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _main(self) -> None:
        engine: Engine | None = None
        try:
            try:
                engine = serving.open_engine(
                    self.config,
                    self.bundle,
                    hooks=serving.Hooks(end_token=self.end_token),
                    progress=self.progress,
                    on_capture=self._captured,
                )
            except Exception as e:
                log.exception("graphrunner serve: the engine failed to start")
                self.failure = e
                return
            self.engine = engine
            # Ready once every runner is captured (the token-batch runner's
            # programs after the decode one's), not at the first capture: a
            # request that came between would wait for the compiler.
            self.ready.set()
            while self._take(engine):
                if not self._step(engine):
                    return
        finally:
            if engine is not None:
                engine.close()
            self.stopped.set()
            self.ready.set()  # nobody waits for a capture that will not come

    def _captured(self, runner: GraphRunner, report: CaptureReport) -> None:
        """Each runner as it is captured: the first (the decode runner) is
        the one ``/metrics`` reads and ``on_capture`` is told of."""
        if self.runner is None:
            self.runner = runner
            if self.on_capture is not None:
                self.on_capture(runner, report)

    def _take(self, engine: Engine) -> bool:
        """At a step boundary: submitted requests into the engine, aborts and
        deadlines out; while idle and open, wait for one. False once closed
        and every request answered. A request stays in ``_tickets`` until
        its last output is posted, so that is what is in flight."""
        inbox = self.inbox
        with inbox.cond:
            while True:
                self._admit(engine)
                self._cut_gone(engine)
                if self._tickets:
                    return True
                if inbox.close_at is not None:
                    return False
                inbox.cond.wait(IDLE_WAIT)

    def _admit(self, engine: Engine) -> None:
        """Under the lock: the inbox's tickets into the engine (a request it
        refuses answered with the reason)."""
        refused: Deliveries = []
        for ticket in self.inbox.tickets:
            job = ticket.job
            stop = None if ticket.stops is None else functools.partial(ticket.stops, ticket.rid)
            try:  # checked on the HTTP side already: a failure here is one request's alone
                engine.add_request(
                    job.prompt,
                    job.max_tokens,
                    job.sampling,
                    rid=ticket.rid,
                    ignore_eos=job.ignore_eos,
                    stop_token_ids=job.stop_token_ids,
                    min_tokens=job.min_tokens,
                    grammar=job.grammar,
                    stop=stop,
                )
            except (TypeError, ValueError) as e:
                refused.append((ticket, Delta.failed(f"the engine refused the request: {e}")))
                continue
            self._tickets[ticket.rid] = ticket
        self.inbox.tickets.clear()
        if refused:
            self._post(refused)

    def _cut_gone(self, engine: Engine) -> None:
        """Under the lock: abort the requests whose client went, whose
        deadline passed, or all once the shutdown's grace is over."""
        inbox, now = self.inbox, time.monotonic()
        gone, inbox.aborts = inbox.aborts, {}
        late = inbox.close_at is not None and now >= inbox.close_at
        for rid, ticket in self._tickets.items():
            if late:
                gone.setdefault(rid, SHUTDOWN)
            elif ticket.deadline is not None and now >= ticket.deadline:
                gone.setdefault(rid, DEADLINE)
        for rid, why in gone.items():
            if rid in self._tickets and rid not in self._cut:
                self._cut[rid] = why
                engine.abort(rid)

    def _step(self, engine: Engine) -> bool:
        """One engine step, its outputs onto the event loop; whether to go on
        (a failing step answers every request in flight with an error, frees
        them all, and the next one starts afresh, up to ``MAX_FAILURES``)."""
        try:
            outputs = engine.step()
        except Exception as e:
            log.exception("graphrunner serve: an engine step failed")
            engine.close()
            self.failures += 1
            self._fail_all(f"the engine failed ({type(e).__name__}: {e})")
            if self.inbox.close_at is not None or self.failures >= MAX_FAILURES:
                self.failure = e
                return False
            return True
        self._publish(outputs)
        return True

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs onto the event loop, in one call: each request's
        new tokens, then how it ended."""
        out: Deliveries = []
        for o in outputs:
            ticket = self._tickets.get(o.rid)
            if ticket is None:
                continue
            if o.tokens:
                logprobs = o.logprobs if ticket.job.logprobs is not None else []
                out.append((ticket, Delta(o.tokens, logprobs)))
            if o.finish_reason is not None:
                out.append(self._ending(o))
        if out:
            self._post(out)

    def _ending(self, last: RequestOutput) -> tuple[Ticket, Delta]:
        """How ``last``'s request ended: its finish reason and what stopped it
        (the stop string, or the stop token id, as vLLM's ``stop_reason``)."""
        rid, reason = last.rid, last.finish_reason
        ticket = self._tickets.pop(rid)
        why = self._cut.pop(rid, None)
        if reason == "abort":
            return ticket, Delta.failed(why or GONE)
        stop: str | int | None = None
        if ticket.stops is not None:
            stop = ticket.stops.hits.pop(rid, None)
        if stop is None and last.tokens and last.tokens[-1] in ticket.job.stop_token_ids:
            stop = last.tokens[-1]
        end = Delta([], finish=reason, stop=stop, cached_tokens=last.cached_tokens, last=True)
        return ticket, end

    def _post(self, out: Deliveries) -> None:
        loop, deliver = self.loop, self.deliver
        if loop is None or deliver is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody listens
            loop.call_soon_threadsafe(deliver, out)

    def _fail_all(self, why: str) -> None:
        """After a failed step (the engine freed its rows and pages): every
        request in flight answered with ``why``."""
        with self.inbox.cond:
            inbox, self.inbox.tickets = self.inbox.tickets, []
        tickets = [*self._tickets.values(), *inbox]
        self._tickets, self._cut = {}, {}
        self._post([(t, Delta.failed(why)) for t in tickets])
