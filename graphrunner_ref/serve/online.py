"""The online engine: one thread owns the model, its pools and the
:class:`~graphrunner_ref.engine.loop.Engine` (built by
:func:`graphrunner_ref.engine.serving.open_engine`, as ``generate`` and
``demo`` build theirs); the HTTP side only submits, aborts and reads.

The engine thread is a short loop: take what the HTTP side queued
(:meth:`Engine.add_request <graphrunner_ref.engine.loop.Engine.add_request>`
for each submitted request, :meth:`Engine.abort
<graphrunner_ref.engine.loop.Engine.abort>` for each one to end), call
:meth:`Engine.step <graphrunner_ref.engine.loop.Engine.step>`, and hand its
outputs (each request's new tokens, its end) to the event loop in one call.
Idle, it waits for a submission. Nothing the HTTP side does touches a pool.

A request is aborted when its client goes (:meth:`OnlineEngine.abort`), its
deadline passes (``--request-timeout``) or the server shuts down past
``--shutdown-timeout`` (:meth:`OnlineEngine.close`). A failing engine step
answers every request in flight with an error, frees them all, and serving
goes on (the server stops after ``MAX_FAILURES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from graphrunner import GraphRunner
from graphrunner.sampling import MAX_SEED
from graphrunner.sizing import CaptureReport
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.loop import Engine
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.engine.results import RequestOutput, TokenLogprobs
from graphrunner_ref.io.stop import StopStrings
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.metrics import Delivery, EngineState, Metrics
from graphrunner_ref.serve.protocol import Job
from graphrunner_ref.serve.structured import Grammars

__all__ = ["Delta", "OnlineEngine", "Ticket", "choice_jobs"]

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
    (``"stop"`` or ``"length"``), the ``stop`` string or stop token id that
    ended it, or the ``error`` that aborted it."""

    tokens: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: str | None = None
    stop: str | int | None = None
    error: str | None = None
    cached_tokens: int = 0  # on the last: its prompt tokens the prefix cache held

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
        progress: show the capture's progress bars on stderr.
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
        progress: bool = False,
    ) -> None:
        self.config, self.bundle, self.codec, self.end_token = config, bundle, codec, end_token
        self.progress = progress
        # Compiles the requests' grammars on the HTTP side (structured output).
        self.grammars = Grammars(config, codec, bundle.config.vocab_size, end_token)
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self.metrics, self.on_capture = metrics, on_capture
        self.runner: GraphRunner | None = None
        self._engine: Engine | None = None  # read by /metrics (counts only)
        metrics.state = self._state
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
        self._cut: dict[int, str] = {}  # aborted in the engine: why
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

    def submit(self, job: Job) -> list[Ticket]:
        """Queue ``job``: one engine request per choice (``job.n``; with a
        seed, choice ``i`` draws with ``seed + i``, as vLLM seeds them), all
        or none; their :class:`Ticket` each. The choices share the prompt:
        the first prefills it, the others wait for its pages and find them
        in the prefix cache. :class:`APIError` 503 (with ``Retry-After``)
        when the server shuts down, has stopped, or ``max_waiting`` requests
        already wait; 400 for ``min_tokens`` with a grammar (the engine
        refuses it, see :class:`~graphrunner_ref.engine.workload.Request`)."""
        self._check_admits(job)
        if self.waiting + job.n > self.max_waiting:
            raise APIError(
                503,
                f"{self.waiting} requests wait for the engine, the most --max-waiting "
                f"{self.max_waiting} allows; expected a retry after {RETRY_AFTER} s",
                code="queue_full",
                headers={"Retry-After": RETRY_AFTER},
            )
        stops = StopStrings(self.codec, job.stops) if job.stops and self.codec else None
        timeout = self.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        tickets = []
        for job_i in choice_jobs(job):
            tickets.append(Ticket(self._next_rid, job_i, deadline, stops))
            self._next_rid += 1
        self.waiting += len(tickets)
        with self._cond:
            self._inbox.extend(tickets)
            self._cond.notify()
        return tickets

    def _check_admits(self, job: Job) -> None:
        """``job`` refused with the :class:`APIError` it meets, if any."""
        if job.grammar is not None and job.min_tokens:
            raise APIError(
                400,
                f"min_tokens={job.min_tokens} with a grammar (structured output): the grammar "
                "decides where the answer ends; expected min_tokens=0",
                param="min_tokens",
            )
        retry = {"Retry-After": RETRY_AFTER}
        if self.closing or not self.healthy:
            why = "is shutting down" if self.closing else "is not serving"
            raise APIError(503, f"the server {why}; expected a retry elsewhere", headers=retry)

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
        """On the event loop: each step's deltas into their tickets' queues,
        their latencies into the metrics (one call)."""
        now = time.perf_counter()
        seen: list[Delivery] = []
        for ticket, delta in out:
            seen.append(self._timed(ticket, delta, now))
            if (delta.tokens or delta.last) and not ticket.started:
                ticket.started = True
                self.waiting -= 1
            ticket.events.put_nowait(delta)
        self.metrics.delivered(seen)

    @staticmethod
    def _timed(ticket: Ticket, delta: Delta, now: float) -> Delivery:
        """What ``delta`` reaching the event loop at ``now`` says about latency."""
        first = gap = None
        if delta.tokens:
            if ticket.first is None:
                ticket.first = first = now
            else:
                assert ticket.last is not None
                gap = now - ticket.last
            ticket.last = now
        ended = None if not delta.last else ("aborted" if delta.error is not None else "finished")
        prompt = len(ticket.job.prompt) if first is not None else 0
        ttft = None if first is None else first - ticket.submitted
        return Delivery(len(delta.tokens), ttft, gap, prompt, ended)

    def _state(self) -> EngineState:
        """The engine's state for ``/metrics`` (read on the event loop: counts only)."""
        engine = self._engine
        running = 0 if engine is None else engine.running()
        return EngineState(self.bundle, self.runner, running, self.waiting)

    # -- the engine thread -----------------------------------------------------------

    def _main(self) -> None:
        engine: Engine | None = None
        try:
            hooks = serving.Hooks(end_token=self.end_token)
            try:
                engine = serving.open_engine(
                    self.config,
                    self.bundle,
                    hooks=hooks,
                    progress=self.progress,
                    on_capture=self._captured,
                )
            except Exception as e:
                log.exception("graphrunner serve: the engine failed to start")
                self.failure = e
                return
            self._engine = engine
            while self._take(engine):
                if not self._step(engine):
                    return
        finally:
            if engine is not None:
                engine.close()
            self.stopped.set()
            self.ready.set()  # nobody waits for a capture that will not come

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
            if self.closing or self.failures >= MAX_FAILURES:
                self.failure = e
                return False
            return True
        self._publish(outputs)
        return True

    def _captured(self, runner: GraphRunner, report: CaptureReport) -> None:
        self.runner = runner
        if self.on_capture is not None and not self.ready.is_set():
            self.on_capture(runner, report)
        self.ready.set()

    def _take(self, engine: Engine) -> bool:
        """At a step boundary: submitted requests into the engine, aborts and
        deadlines out; while idle and open, wait for one. False once closed
        and every request answered."""
        with self._cond:
            while True:
                self._admit(engine)
                self._cut_gone(engine)
                if engine.has_unfinished():
                    return True
                if self._close_at is not None:
                    return False
                self._cond.wait(IDLE_WAIT)

    def _admit(self, engine: Engine) -> None:
        """Under the lock: the inbox into the engine (a request it refuses
        answered with the reason)."""
        refused: list[tuple[Ticket, Delta]] = []
        for ticket in self._inbox:
            job = ticket.job
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
                    stop=None
                    if ticket.stops is None
                    else functools.partial(ticket.stops, ticket.rid),
                )
            except (TypeError, ValueError) as e:
                refused.append((ticket, Delta([], error=f"the engine refused the request: {e}")))
                continue
            self._tickets[ticket.rid] = ticket
        self._inbox.clear()
        if refused:
            self._post(refused)

    def _cut_gone(self, engine: Engine) -> None:
        """Under the lock: abort the requests whose client went, whose
        deadline passed, or all once the shutdown's grace is over."""
        now = time.monotonic()
        gone, self._aborts = self._aborts, {}
        late = self._close_at is not None and now >= self._close_at
        for rid, ticket in self._tickets.items():
            if late:
                gone.setdefault(rid, SHUTDOWN)
            elif ticket.deadline is not None and now >= ticket.deadline:
                gone.setdefault(rid, DEADLINE)
        for rid, why in gone.items():
            if rid in self._tickets and rid not in self._cut:
                self._cut[rid] = why
                engine.abort(rid)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs onto the event loop, in one call: each request's
        new tokens, then how it ended."""
        out: list[tuple[Ticket, Delta]] = []
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
            return ticket, Delta([], error=why or GONE)
        stop: str | int | None = None
        if ticket.stops is not None:
            stop = ticket.stops.hits.pop(rid, None)
        if stop is None and last.tokens and last.tokens[-1] in ticket.job.stop_token_ids:
            stop = last.tokens[-1]
        return ticket, Delta([], finish=reason, stop=stop, cached_tokens=last.cached_tokens)

    def _post(self, out: list[tuple[Ticket, Delta]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody listens
            loop.call_soon_threadsafe(self._deliver, out)

    def _fail_all(self, why: str) -> None:
        """After a failed step (the engine freed its rows and pages): every
        request in flight answered with ``why``."""
        with self._cond:
            inbox, self._inbox = self._inbox, []
        tickets = [*self._tickets.values(), *inbox]
        self._tickets, self._cut = {}, {}
        self._post([(t, Delta([], error=why)) for t in tickets])


def choice_jobs(job: Job) -> list[Job]:
    """The engine request of each of ``job``'s ``n`` choices: choice ``i``
    draws with ``seed + i`` where a seed is given (vLLM's way: reproducible,
    and the choices differ), else with the seed the engine derives for it."""
    seed = job.sampling.seed
    if job.n == 1 or seed is None:
        return [job] * job.n
    return [
        replace(job, sampling=replace(job.sampling, seed=(seed + i) % MAX_SEED))
        for i in range(job.n)
    ]
