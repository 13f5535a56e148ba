"""An interrupted run loses nothing: a request's callback that raises (an
error, or Ctrl-C inside it) mid-step leaves every pool row and KV slot free
after the run, on every schedule (plain, overlap, several steps per launch,
both), and the error reaches the caller."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from graphrunner import FutureMap
from graphrunner_ref import Engine, Request, create_decode_runner, default_model

TRACE = [
    Request(0, (1, 2, 3), 3),
    Request(1, (4, 5), 6),
    Request(2, (6,), 6, arrival_step=1),
]


def _raising(exc: type[BaseException]) -> Callable[..., None]:
    def callback(rid: int, *_: object) -> None:
        if rid == 0:  # request 0 finishes first, with the others mid-flight
            raise exc("from a callback")

    return callback


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("hook", ["on_finish", "on_token"])
def test_a_raising_callback_leaks_no_row_and_no_kv_slot(
    steps: int, overlap: bool, exc: type[BaseException], hook: str
) -> None:
    bundle = default_model(max_requests=4, max_context_len=64)
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device) if overlap else None
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=[1, 2, 4], future_map=future, steps_per_launch=steps
    )
    runner.capture()
    engine = Engine(bundle, runner, overlap=overlap, steps_per_launch=steps)
    setattr(engine.post, hook, _raising(exc))
    with pytest.raises(exc, match="from a callback"):
        engine.run(TRACE)
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size
    assert bundle.req_pool.available_size() == 4
    setattr(engine.post, hook, None)  # the engine serves the next run whole
    assert set(engine.run(TRACE).outputs) == {0, 1, 2}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_ctrl_c_right_after_an_allocation_leaks_nothing(
    overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT arriving between a KV allocation and its record (the moment a
    raw KeyboardInterrupt would lose the slots) is held to the step's end:
    the run raises KeyboardInterrupt and every slot and row is free again."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        bundle = default_model(max_requests=4, max_context_len=64)
        future = (
            FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device) if overlap else None
        )
        runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], future_map=future)
        runner.capture()
        engine = Engine(bundle, runner, overlap=overlap)
        real, calls = bundle.kv_alloc.alloc, []

        def alloc_then_interrupted(need: int) -> list[int]:
            slots = real(need)
            calls.append(need)
            if len(calls) == 4:  # mid-run: a decode step's slot
                os.kill(os.getpid(), signal.SIGINT)
            return slots

        monkeypatch.setattr(bundle.kv_alloc, "alloc", alloc_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.run(TRACE)
        assert len(calls) >= 4
        assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size
        assert bundle.req_pool.available_size() == 4
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
