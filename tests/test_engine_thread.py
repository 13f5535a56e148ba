"""The server's engine thread says it is ready only once every runner its
engine takes is captured: the token-batch runner's programs compile after
the decode runner's, and a server that listened between the two made its
first requests wait for the compiler (``/health`` said ok)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import graphrunner_ref.serve.engine_thread as engine_thread
from graphrunner_ref.serve.engine_thread import EngineThread, Inbox


class _IdleEngine:
    """An engine with nothing to run: the thread's loop waits on its inbox."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_ready_waits_for_every_runner_and_on_capture_hears_of_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decode, tokens = object(), object()
    first_captured, release = threading.Event(), threading.Event()
    engine = _IdleEngine()

    def open_engine(*args: Any, on_capture: Any, **kwargs: Any) -> _IdleEngine:
        on_capture(decode, "decode report")
        first_captured.set()
        assert release.wait(30), "the test never released the second capture"
        on_capture(tokens, "token report")
        return engine

    monkeypatch.setattr(engine_thread.serving, "open_engine", open_engine)
    told: list[tuple[object, object]] = []
    inbox = Inbox()
    thread = EngineThread(
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        inbox,
        end_token=None,
        on_capture=lambda runner, report: told.append((runner, report)),
    )
    thread.start()
    try:
        assert first_captured.wait(30)
        assert not thread.ready.wait(0.3), "ready while the token-batch runner still captured"
        release.set()
        assert thread.ready.wait(30)
        assert thread.failure is None
        assert thread.runner is decode  # what /metrics reads
        assert told == [(decode, "decode report")]
    finally:
        release.set()
        with inbox.cond:
            inbox.close_at = 0.0
            inbox.cond.notify()
        assert thread.join(30)
    assert engine.closed
