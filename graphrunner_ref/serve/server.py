"""Start and stop ``graphrunner serve``: bind the port, capture on the engine
thread, serve HTTP with uvicorn on the main thread, and shut down cleanly.

SIGTERM or Ctrl-C stops admitting (new requests and ``/health`` answer 503),
lets the requests in flight finish within ``--shutdown-timeout`` seconds,
then aborts the rest with an error event; the engine run frees every request
row and KV page, and :func:`run` returns 0. A second Ctrl-C stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType

import uvicorn

from graphrunner_ref.engine.config import EngineConfig, UsageError
from graphrunner_ref.engine.registry import ServingBundle
from graphrunner_ref.serve.app import ServeState, create_app
from graphrunner_ref.serve.metrics import Metrics
from graphrunner_ref.serve.online import OnCapture, OnlineEngine
from graphrunner_ref.serve.protocol import Limits

__all__ = ["ServerOptions", "bind", "run"]

log = logging.getLogger("graphrunner.serve")

#: Seconds uvicorn waits for connections beyond ``--shutdown-timeout`` (the
#: engine has aborted every request by then: their streams end).
_GRACE = 5.0


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """The server's own options (the engine's are its :class:`EngineConfig`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "embedded"
    api_key: str | None = None
    max_waiting: int = 256
    shutdown_timeout: float = 30.0
    request_timeout: float | None = None
    log_level: str = "warning"


class _Server(uvicorn.Server):
    """uvicorn's server, whose signals first close the engine (stop
    admitting, a deadline for the requests in flight) and are not raised
    again once it has shut down (the command exits 0)."""

    def __init__(
        self, config: uvicorn.Config, engine: OnlineEngine, timeout: float, address: str
    ) -> None:
        super().__init__(config)
        self.engine, self.timeout, self.address = engine, timeout, address

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # said once the socket accepts connections
            print(f"graphrunner serve: listening on {self.address}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            print(
                f"graphrunner serve: {signal.Signals(sig).name}: no new requests; those in "
                f"flight have {self.timeout:g} s to finish",
                file=sys.stderr,
                flush=True,
            )
        self.engine.close(self.timeout)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port`` (0: a free port), bound
    before any model work so a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror})"
        ) from None
    sock.set_inheritable(True)
    return sock


def run(
    config: EngineConfig,
    bundle: ServingBundle,
    limits: Limits,
    options: ServerOptions,
    *,
    end_token: int | None,
    on_capture: OnCapture | None = None,
    sock: socket.socket | None = None,
    progress: bool = False,
) -> int:
    """Serve ``bundle`` over HTTP until a signal stops it; the exit status
    (0 after a clean shutdown, 1 when the engine failed). ``sock``: bound
    already (:func:`bind`; None: bound here to ``options``' host and port).
    ``progress``: the capture's progress bars on stderr."""
    sock = sock or bind(options.host, options.port)
    metrics = Metrics()
    engine = OnlineEngine(
        config,
        bundle,
        codec=limits.codec,
        end_token=end_token,
        max_waiting=options.max_waiting,
        request_timeout=options.request_timeout,
        metrics=metrics,
        on_capture=on_capture,
        progress=progress,
    )
    state = ServeState(
        engine, options.model_name, limits, options.api_key, metrics, int(time.time())
    )
    app = create_app(state)
    uconfig = uvicorn.Config(
        app,
        log_level=options.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(options.shutdown_timeout + _GRACE),
        lifespan="off",
    )
    host, port = sock.getsockname()[:2]
    address = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    server = _Server(uconfig, engine, options.shutdown_timeout, address)
    engine.start()
    try:
        return _serve(server, engine, sock, options)
    finally:
        engine.close(0)
        engine.join(options.shutdown_timeout + _GRACE)
        sock.close()


def _serve(
    server: _Server, engine: OnlineEngine, sock: socket.socket, options: ServerOptions
) -> int:
    # Signals during the capture stop it as any command stops (the caller's
    # handlers); from here on they are the server's.
    while not engine.ready.wait(0.2):
        pass
    if engine.failure is not None:
        print(f"graphrunner serve: error: the engine failed: {engine.failure}", file=sys.stderr)
        return 1

    async def main() -> None:
        engine.bind(asyncio.get_running_loop())
        await server.serve(sockets=[sock])

    asyncio.run(main())
    engine.close(0)
    ended = engine.join(options.shutdown_timeout + _GRACE)
    if engine.failure is not None:
        print(f"graphrunner serve: error: the engine failed: {engine.failure}", file=sys.stderr)
        return 1
    print(
        "graphrunner serve: stopped" + ("" if ended else " (the engine thread did not end)"),
        file=sys.stderr,
        flush=True,
    )
    return 0 if ended else 1
