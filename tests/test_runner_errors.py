"""Runner construction, capture and replay errors name what is wrong and
leave nothing half-captured."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from graphrunner import GraphRunner, NotCapturedError, create_runner, decode_buffer_specs
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.mechanisms.eager import EagerCapture
from graphrunner.sizing.sizes import BatchSizeError
from graphrunner.testing import ToyWorld
from graphrunner.writers.base import PopulateError


def make(forward: object, sizes: list[int]) -> GraphRunner:
    return create_runner(
        forward,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=sizes,  # type: ignore[arg-type]
        show_progress=False,
        kind="eager",
    )


def test_bad_construction():
    with pytest.raises(TypeError, match="step must be a Phase or a callable forward, got int"):
        make(3, [1])
    with pytest.raises(ValueError, match="at least one static buffer"):
        create_runner(lambda v: v, [], device="cpu", capture_sizes=[1], kind="eager")
    with pytest.raises(ValueError, match="give capture_sizes or max_bs"):
        create_runner(lambda v: v, decode_buffer_specs(), device="cpu", kind="eager")
    with pytest.raises(ValueError, match="max_bs=8 disagrees with the largest capture size 4"):
        create_runner(
            lambda v: v,
            decode_buffer_specs(),
            device="cpu",
            capture_sizes=[1, 4],
            max_bs=8,
            kind="eager",
        )


def test_failed_capture_keeps_nothing_and_can_be_retried():
    world = ToyWorld()
    fail = {"on": True}

    def forward(b: object) -> torch.Tensor:
        if fail["on"] and b.bs == 2:  # type: ignore[attr-defined]
            raise RuntimeError("boom at bs=2")
        return world.model(b)

    runner = make(forward, [1, 2, 4])
    with pytest.raises(RuntimeError, match="boom at bs=2"):
        runner.capture()
    assert not runner.is_captured and runner.capture_report is None
    with pytest.raises(NotCapturedError, match=r"not captured \(batch of 3\); call capture"):
        runner.replay(world.make_batch(3, seed=0))
    # Not even a batch above every size runs before capture (no silent eager run).
    with pytest.raises(NotCapturedError, match="batch of 6"):
        runner.replay(world.make_batch(6, seed=0))
    assert runner.stats.eager_fallbacks == 0
    fail["on"] = False
    runner.capture()
    assert runner.is_captured
    with pytest.raises(RuntimeError, match="already captured"):
        runner.capture()


def test_replay_of_something_that_is_not_a_batch():
    runner = make(ToyWorld().model, [1])
    runner.capture()
    with pytest.raises(TypeError, match="SimpleNamespace has no int batch_size"):
        runner.replay(SimpleNamespace(input_ids=torch.zeros(1, dtype=torch.int64)))


def test_a_batch_of_no_rows_is_an_error_not_a_fallback():
    world = ToyWorld()
    runner = make(world.model, [1, 2])
    runner.capture()
    empty = DecodeBatch.empty("cpu", world.cfg.max_context_len)
    with pytest.raises(BatchSizeError, match="batch_size 0: replay needs at least one live row"):
        runner.replay(empty)
    with pytest.raises(TypeError, match="batch_size"):
        runner.replay(SimpleNamespace(batch_size=True))
    assert runner.stats.eager_fallbacks == 0 and runner.stats.replays == 0


def test_fallback_warns_at_the_caller_and_checks_inputs():
    world = ToyWorld()
    runner = make(world.model, [1, 2])
    runner.capture()
    batch = world.make_batch(3, seed=0)
    fields = {s.name: getattr(batch, s.name) for s in decode_buffer_specs()}
    bad = SimpleNamespace(**fields, batch_size=3)
    bad.seq_lens = batch.seq_lens.to(torch.int32)
    with pytest.raises(PopulateError, match="'seq_lens' has dtype torch.int32"):
        runner.replay(bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.replay(batch)
        runner.replay(batch)
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def test_a_failing_eager_fallback_leaves_stats_unchanged():
    world = ToyWorld()
    fail = {"on": False}

    def forward(b: object) -> torch.Tensor:
        if fail["on"]:
            raise RuntimeError("boom in the eager forward")
        return world.model(b)

    runner = make(forward, [1, 2])
    runner.capture()
    fail["on"] = True
    with pytest.raises(RuntimeError, match="boom"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.replay(world.make_batch(3, seed=0))
    assert (runner.stats.eager_fallbacks, runner.stats.live_rows) == (0, 0)


def test_capture_leaves_the_applications_gc_freeze_alone(monkeypatch: pytest.MonkeyPatch):
    # The freeze a capturing or compiling mechanism makes, on the quick eager one.
    monkeypatch.setattr(EagerCapture, "freezes_heap", True)
    world = ToyWorld()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        make(world.model, [1, 2]).capture()
        assert gc.get_freeze_count() >= frozen > 0
    finally:
        gc.unfreeze()
    make(world.model, [1]).capture()
    assert gc.get_freeze_count() == 0  # ours is undone when the application froze nothing


def test_an_eager_capture_never_collects_the_heap(monkeypatch: pytest.MonkeyPatch):
    # Nothing is captured or compiled: a full collection would cost tenths of a second.
    collections: list[object] = []
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(args) or 0)
    make(ToyWorld().model, [1, 2]).capture()
    assert (collections, gc.get_freeze_count()) == ([], 0)
