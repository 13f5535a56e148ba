"""The engine reads top to bottom: a step's control returns to a module it
has left only where the loop hands over to the next stage (plan, run,
postprocess), and a streamed completion crosses the server's modules a
bounded number of times; traced with ``sys.setprofile``
(``bench/trace_modules.py``)."""

from __future__ import annotations

import re
from pathlib import Path

from bench.trace_modules import chunked_prefill_step, streamed_completion

ENGINE = Path(__file__).resolve().parents[1] / "graphrunner_ref" / "engine"


def test_a_chunked_prefill_step_is_plan_run_postprocess() -> None:
    trace = chunked_prefill_step()
    (seq,) = trace.threads.values()
    stages = [m for m in seq if m != "engine/loop.py"]
    assert stages == ["engine/scheduler.py", "engine/model_runner.py", "engine/postprocess.py"], (
        trace.summary()
    )
    assert trace.returns <= 4, trace.summary()


def test_the_scheduler_and_the_admission_call_nothing_on_the_engine() -> None:
    for name in ("scheduler.py", "admission.py", "workload.py"):
        source = (ENGINE / name).read_text()
        assert not re.search(r"\bengine\.[a-z_]+\(", source), name
        assert "graphrunner_ref.engine.loop" not in source, name


def test_a_streamed_completion_crosses_few_modules() -> None:
    """From the HTTP handler to the first token chunk: the HTTP side enters
    ``serve/online.py`` to submit and to take the step's deltas only (the
    engine thread's loop is ``serve/engine_thread.py``'s), and the moves of
    both threads stay within the goal of 20 (19 measured, from 62): an
    added request is built and checked in one call, a plain greedy
    request's first token is its argmax."""
    trace = streamed_completion()
    assert trace.entries("serve/online.py") <= 3, trace.summary()
    assert trace.moves <= 20, trace.summary()
