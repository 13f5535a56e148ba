"""Churn soak: the engine serves a long random trace on the embedded reference
model (context 48, 8 request rows, the eager runner with the padding
sanitizer on every replay): random arrivals, random prompt lengths and token
budgets (finishes), and every freed request row and KV slot handed out again.

At the end every pool's free count is back where it started, slot 0 and row 0
were never handed out (the sanitizer checks this before every replay; the
pools' allocation log checks every allocation), and the counts print in the
terminal summary: a quick 300 decode steps, and a long soak of 20,000.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from conftest import SOAK_REPORTS
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import synthetic_trace
from graphrunner_ref.model import ModelBundle, default_model

CONTEXT = 48
MAX_REQUESTS = 8
CAPTURE_SIZES = [1, 2, 4, 8]
LONG_STEPS = 20_000
QUICK_STEPS = 300


@dataclass
class AllocLog:
    """Wraps a pool's ``alloc`` on the instance: counts what it hands out and how
    much of it was handed out before (reuse), and notes any reserved index 0."""

    handed_out: int = 0
    reuses: int = 0
    zero_handed_out: int = 0
    seen: set[int] = field(default_factory=set)

    def wrap(self, pool: Any) -> None:
        alloc: Callable[[int], list[int]] = pool.alloc

        def logged(n: int) -> list[int]:
            got = alloc(n)
            self.handed_out += len(got)
            self.reuses += sum(i in self.seen for i in got)
            self.zero_handed_out += got.count(0)
            self.seen.update(got)
            return got

        pool.alloc = logged


@dataclass
class SoakResult:
    bundle: ModelBundle
    steps: int
    requests: int
    finished: int
    rows: AllocLog
    slots: AllocLog
    start_free: tuple[int, int]
    replays: int
    padded_replays: int  # decode steps whose live batch was smaller than its graph
    sanitized: int
    seconds: float


def free_counts(bundle: ModelBundle) -> tuple[int, int]:
    return bundle.req_pool.available_size(), bundle.kv_alloc.available_size()


def soak(steps: int, *, seed: int = 0, leak_every: int = 0) -> SoakResult:
    """Serve a seeded random trace for exactly ``steps`` decode steps.

    The trace has more requests than the steps can serve, so arrivals go on
    to the end; requests still running or waiting at the cut are freed or
    never admitted by the engine. ``leak_every=k`` drops every k-th freed KV slot list on purpose
    (a planted leak, for the test that proves the pool check can fail).
    """
    bundle = default_model(max_requests=MAX_REQUESTS, max_context_len=CONTEXT)
    runner = create_decode_runner(bundle, "eager", capture_sizes=CAPTURE_SIZES, check_padding=True)
    runner.capture()
    start_free = free_counts(bundle)
    rows, slots = AllocLog(), AllocLog()
    rows.wrap(bundle.req_pool)
    slots.wrap(bundle.kv_alloc)
    if leak_every:
        free, frees = bundle.kv_alloc.free, [0]

        def leaky_free(freed: Any) -> None:
            frees[0] += 1
            if frees[0] % leak_every:
                free(freed)

        bundle.kv_alloc.free = leaky_free
    trace = synthetic_trace(
        num_requests=steps,  # more than ``steps`` decode steps can serve
        vocab_size=bundle.config.vocab_size,
        max_context_len=CONTEXT,
        seed=seed,
        prompt_len=(1, 32),
        new_tokens=(1, 32),
        mean_gap=2.5,  # about what 8 rows serve: the batch swings through every size
    )
    start = time.perf_counter()
    result = Engine(bundle, runner).run(trace, max_steps=steps)
    seconds = time.perf_counter() - start
    stats, sanitizer = runner.stats, runner.sanitizer
    assert sanitizer is not None
    return SoakResult(
        bundle=bundle,
        steps=result.stats.steps,
        requests=result.stats.prefills,
        finished=len(result.finished),
        rows=rows,
        slots=slots,
        start_free=start_free,
        replays=stats.replays + stats.eager_fallbacks,
        padded_replays=sum(
            n for bs, n in result.stats.batch_sizes.items() if runner.graph_size_for(bs) > bs
        ),
        sanitized=sanitizer.stats.replays_checked,
        seconds=seconds,
    )


def check_soak(r: SoakResult, steps: int) -> None:
    bundle = r.bundle
    assert r.steps == steps
    # Every step went through the runner, and the sanitizer checked each one
    # (slot 0 and row 0 never handed out, row 0 of req_to_token all zeros, ...).
    assert r.replays == r.sanitized == steps
    assert free_counts(bundle) == r.start_free, "a pool did not get every row or slot back"
    assert r.rows.zero_handed_out == r.slots.zero_handed_out == 0
    assert not bundle.req_pool.is_allocated(0)
    assert not bundle.kv_alloc.is_allocated(0)
    assert not bundle.req_pool.req_to_token[0].any()
    assert not bundle.req_pool.allocated() and not bundle.kv_alloc.allocated()
    # Churn happened: requests finished and their rows and slots were reused.
    assert r.finished > 0 and r.requests > MAX_REQUESTS
    assert r.rows.reuses > 0 and r.slots.reuses > 0
    assert r.padded_replays > 0


def report(r: SoakResult, label: str) -> str:
    return (
        f"churn soak ({label}): {r.steps:,} decode steps ({r.padded_replays:,} padded), "
        f"{r.requests:,} requests admitted ({r.finished:,} finished), "
        f"{r.rows.handed_out:,} request rows handed out ({r.rows.reuses:,} reuses), "
        f"{r.slots.handed_out:,} KV slots handed out ({r.slots.reuses:,} reuses), "
        f"pools back to {r.start_free} free, slot 0 never handed out; {r.seconds:.1f} s"
    )


def test_churn_soak_quick() -> None:
    r = soak(QUICK_STEPS, seed=1)
    SOAK_REPORTS.append(report(r, "quick"))
    check_soak(r, QUICK_STEPS)


def test_churn_soak_20000_steps() -> None:
    r = soak(LONG_STEPS, seed=2)
    SOAK_REPORTS.append(report(r, "long"))
    check_soak(r, LONG_STEPS)


def test_the_soak_check_catches_a_leaked_slot() -> None:
    r = soak(60, seed=3, leak_every=5)
    with pytest.raises(AssertionError, match="did not get every row or slot back"):
        check_soak(r, 60)
