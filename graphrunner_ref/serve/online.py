"""The HTTP side of the online engine: :class:`OnlineEngine` is what the
routes talk to. It submits, aborts and reads; the engine itself lives on its
own thread (:class:`~graphrunner_ref.serve.engine_thread.EngineThread`), which
takes what :meth:`OnlineEngine.submit` queues in its inbox and posts each
step's deltas back to the event loop (:meth:`OnlineEngine._deliver`). Nothing
the HTTP side does touches the engine or a pool.

A request is aborted when its client goes (:meth:`OnlineEngine.abort`), its
deadline passes (``--request-timeout``) or the server shuts down past
``--shutdown-timeout`` (:meth:`OnlineEngine.close`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from graphrunner import GraphRunner
from graphrunner.sampling import MAX_SEED
from graphrunner.sizing import CaptureReport
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.io.stop import StopStrings
from graphrunner_ref.io.text import TextCodec
from graphrunner_ref.serve.engine_thread import (
    DEADLINE,
    GONE,
    IDLE_WAIT,
    SHUTDOWN,
    Deliveries,
    Delta,
    EngineThread,
    Inbox,
    Ticket,
)
from graphrunner_ref.serve.errors import APIError
from graphrunner_ref.serve.metrics import FOLD_EVERY, Delivery, EngineState, Metrics
from graphrunner_ref.serve.protocol import Job
from graphrunner_ref.serve.structured import Grammars

__all__ = [
    "DEADLINE",
    "GONE",
    "IDLE_WAIT",
    "SHUTDOWN",
    "Delta",
    "OnCapture",
    "OnlineEngine",
    "Ticket",
    "choice_jobs",
]

#: What a client told to retry waits, in seconds.
RETRY_AFTER = "1"


OnCapture = Callable[[GraphRunner, CaptureReport], None]


class OnlineEngine:
    """The HTTP side of the online engine (see the module doc) over its
    :class:`~graphrunner_ref.serve.engine_thread.EngineThread`.

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
        self.bundle, self.codec = bundle, codec
        # Compiles the requests' grammars on the HTTP side (structured output).
        self.grammars = Grammars(config, codec, bundle.config.vocab_size, end_token)
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self.metrics = metrics
        metrics.state = self._state
        self.closing = False
        self.waiting = 0  # event loop: submitted, no token yet
        self._next_rid = 0
        self.inbox = Inbox()
        self.thread = EngineThread(
            config, bundle, self.inbox, end_token=end_token, on_capture=on_capture,
            progress=progress,
        )  # fmt: skip
        self.thread.deliver = self._deliver
        #: Set once the runner is captured (or the engine failed to start).
        self.ready: threading.Event = self.thread.ready

    def start(self) -> None:
        """Start the engine thread (it captures, then serves)."""
        self.thread.start()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the tickets' queues live on (the engine thread
        posts each step's deltas there)."""
        self.thread.loop = loop

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine (None while it serves)."""
        return self.thread.failure

    @property
    def healthy(self) -> bool:
        thread = self.thread
        return thread.ready.is_set() and thread.failure is None and not thread.stopped.is_set()

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
        with self.inbox.cond:
            self.inbox.tickets.extend(tickets)
            self.inbox.cond.notify()
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
        with self.inbox.cond:
            self.inbox.aborts[ticket.rid] = why
            self.inbox.cond.notify()

    def close(self, timeout: float) -> None:
        """Admit nothing more; requests in flight may finish within
        ``timeout`` seconds, then are aborted with an error. The engine thread
        ends once none is left."""
        self.closing = True
        with self.inbox.cond:
            if self.inbox.close_at is None:
                self.inbox.close_at = time.monotonic() + timeout
            self.inbox.cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread; whether it ended."""
        return self.thread.join(timeout)

    def _deliver(self, out: Deliveries) -> None:
        """On the event loop: each step's deltas into their tickets' queues,
        their latencies queued for the metrics (folded when ``/metrics`` is
        read, or every ``FOLD_EVERY`` deliveries)."""
        now = time.perf_counter()
        seen: list[Delivery] = []
        for ticket, delta in out:
            seen.append(self._timed(ticket, delta, now))
            if (delta.tokens or delta.last) and not ticket.started:
                ticket.started = True
                self.waiting -= 1
            ticket.events.put_nowait(delta)
        pending = self.metrics.pending
        pending += seen
        if len(pending) >= FOLD_EVERY:
            self.metrics.fold()

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
        engine = self.thread.engine
        running = 0 if engine is None else engine.running()
        return EngineState(self.bundle, self.thread.runner, running, self.waiting)


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
