"""Concurrent misuse is an error, never wrong results: a second thread
entering an engine's run while another is inside gets ConcurrentUseError;
the run inside finishes correctly, and the engine serves again after."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from graphrunner.util.exclusive import ConcurrentUseError, Exclusive
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request, synthetic_trace
from graphrunner_ref.model import default_model


def _trace(bundle: Any, requests: int) -> list[Request]:
    return synthetic_trace(
        num_requests=requests,
        vocab_size=bundle.model.config.vocab_size,
        max_context_len=48,
        prompt_len=(2, 8),
        new_tokens=(2, 6),
    )


def test_a_second_entry_is_refused_naming_the_call_and_the_thread() -> None:
    guard = Exclusive("Thing.call")
    with (
        guard.held(),
        pytest.raises(
            ConcurrentUseError, match=r"Thing.call is already running \(in thread 'MainThread'\)"
        ),
        guard.held(),
    ):
        pass
    with guard.held():  # released: usable again
        pass


def _second_call_while_inside(
    first: Callable[[], object],
    second: Callable[[], object],
    inside: threading.Event,
    release: threading.Event,
) -> list[BaseException]:
    """Run ``first`` in a thread until it signals ``inside``, then ``second``
    here; return what ``second`` raised, after releasing and joining the first."""
    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(timeout=60)
    errors: list[BaseException] = []
    try:
        second()
    except BaseException as e:  # the caller names it
        errors.append(e)
    release.set()
    thread.join(timeout=120)
    return errors


def engine_run_from_a_second_thread() -> tuple[list[BaseException], bool]:
    """What a second thread's ``Engine.run`` raised while a first run was inside
    (blocked in its finish hook), and whether the first run's outputs, and the
    engine's next run, are exactly those of an undisturbed run."""
    bundle = default_model(max_requests=4, max_context_len=48)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    trace = _trace(bundle, 6)
    expected = Engine(bundle, runner).run(trace).outputs

    inside, release = threading.Event(), threading.Event()

    def on_finish(rid: int, tokens: list[int]) -> None:
        inside.set()
        release.wait(timeout=60)

    engine = Engine(bundle, runner, on_finish=on_finish)
    results: list[dict[int, list[int]]] = []
    errors = _second_call_while_inside(
        lambda: results.append(engine.run(trace).outputs),
        lambda: engine.run(trace),
        inside,
        release,
    )
    exact = results == [expected] and engine.run(trace).outputs == expected  # released after
    return errors, exact


def test_a_second_thread_in_engine_run_is_refused_and_the_first_run_is_exact() -> None:
    errors, exact = engine_run_from_a_second_thread()
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentUseError)
    assert "Engine.run is already running" in str(errors[0])
    assert exact


def interrupt_at_every_step() -> tuple[list[BaseException | None], list[bool], bool]:
    """KeyboardInterrupt raised inside the k-th replay of one trace, for every
    step k: what each run raised, whether every request row and KV slot it
    handed out was free again after it, and whether the engine then serves
    the trace exactly as before."""
    bundle = default_model(max_requests=4, max_context_len=48)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    trace = _trace(bundle, 5)
    engine = Engine(bundle, runner)
    expected = engine.run(trace)
    start = (bundle.req_pool.available_size(), bundle.kv_alloc.available_size())
    replay = runner.replay
    raised: list[BaseException | None] = []
    freed: list[bool] = []
    for k in range(1, expected.stats.steps + 1):
        calls = 0

        def interrupted(inputs: object, k: int = k) -> object:
            nonlocal calls
            calls += 1
            if calls == k:
                raise KeyboardInterrupt
            return replay(inputs)

        setattr(runner, "replay", interrupted)  # noqa: B010 - an instance override
        try:
            engine.run(trace)
            raised.append(None)
        except KeyboardInterrupt as e:
            raised.append(e)
        finally:
            del runner.replay  # the class method again
        freed.append((bundle.req_pool.available_size(), bundle.kv_alloc.available_size()) == start)
    return raised, freed, engine.run(trace).outputs == expected.outputs


def test_an_interrupt_at_every_step_boundary_frees_every_slot() -> None:
    raised, freed, exact = interrupt_at_every_step()
    assert len(raised) > 1 and all(isinstance(e, KeyboardInterrupt) for e in raised)
    assert all(freed), freed
    assert exact


#: Request fields refused by type or value: (the fields changed, the error).
REQUEST_CASES: list[tuple[dict[str, object], str]] = [
    ({"rid": True}, r"request True: rid=True \(bool\); expected an int"),
    ({"max_new_tokens": 2.0}, r"max_new_tokens=2.0 \(float\); expected an int"),
    ({"max_new_tokens": 0}, r"max_new_tokens=0; expected >= 1"),
    ({"arrival_step": "1"}, r"arrival_step='1' \(str\); expected an int"),
    ({"prompt": (1, 2.5)}, r"prompt\[1\]=2.5 \(float\); expected an int"),
    ({"prompt": [1, 2]}, r"prompt is a list; expected a tuple of int token ids"),
    ({"prompt": (1.7,)}, r"prompt\[0\]=1.7 \(float\); expected an int"),
    ({"prompt": (True, 2)}, r"prompt\[0\]=True \(bool\); expected an int"),
    ({"prompt": (1, np.float32(2))}, r"prompt\[1\]=np.float32\(2.0\) \(float32\); expected an int"),
    ({"prompt": "hello"}, r"request 0: prompt is a str; expected a tuple of int token ids"),
    ({"prompt": torch.tensor([1, 2])}, r"request 0: prompt is a Tensor; expected a tuple"),
    ({"prompt": ()}, r"request 0: empty prompt; expected at least one token"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens=2.5 \(float\); expected an int"),
    ({"max_new_tokens": float("nan")}, r"max_new_tokens=nan \(float\); expected an int"),
    ({"arrival_step": -1}, r"arrival_step=-1; expected >= 0"),
]


@pytest.mark.parametrize("kwargs, message", REQUEST_CASES)
def test_a_request_takes_exact_types_and_names_the_field(
    kwargs: dict[str, object], message: str
) -> None:
    fields: dict[str, object] = {"rid": 0, "prompt": (1, 2), "max_new_tokens": 3, **kwargs}
    with pytest.raises((TypeError, ValueError), match=message):
        Request(**fields)  # type: ignore[arg-type]


def replay_from_a_second_thread() -> tuple[list[BaseException], bool]:
    """What a second thread's ``runner.replay`` raised while a first replay was
    inside its forward, and whether the first replay's output, and the next
    replay's, are exactly those of an undisturbed replay."""
    from graphrunner import create_runner, decode_buffer_specs
    from graphrunner.testing import ToyWorld

    world = ToyWorld()
    inside, release = threading.Event(), threading.Event()
    blocking = False

    def forward(view: object) -> torch.Tensor:
        if blocking and not inside.is_set():  # the first replay waits inside its forward
            inside.set()
            release.wait(timeout=60)
        return world.model.forward(view)

    runner = create_runner(
        forward, decode_buffer_specs(), device="cpu", capture_sizes=[1, 2, 4], kind="eager"
    )
    runner.capture()
    batch = world.make_batch(3, seed=0)
    expected = runner.replay(batch).clone()
    blocking = True
    got: list[torch.Tensor] = []
    errors = _second_call_while_inside(
        lambda: got.append(runner.replay(batch).clone()),
        lambda: runner.replay(batch),
        inside,
        release,
    )
    exact = len(got) == 1 and torch.equal(got[0], expected)
    return errors, exact and torch.equal(runner.replay(batch), expected)  # released after


def test_a_second_thread_in_a_runners_replay_is_refused() -> None:
    errors, exact = replay_from_a_second_thread()
    assert len(errors) == 1 and isinstance(errors[0], ConcurrentUseError)
    assert re.search(r"GraphRunner.replay is already running", str(errors[0]))
    assert exact
