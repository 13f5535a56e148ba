"""Runner construction, capture and replay errors name what is wrong and
leave nothing half-captured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graphrunner import EagerRunner, NotCapturedError, decode_buffer_specs
from graphrunner.testing import ToyWorld


def make(forward: object, sizes: list[int]) -> EagerRunner:
    return EagerRunner(
        forward,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=sizes,  # type: ignore[arg-type]
        show_progress=False,
    )


def test_bad_construction():
    with pytest.raises(TypeError, match="forward must be callable, got int"):
        make(3, [1])
    with pytest.raises(ValueError, match="at least one static buffer"):
        EagerRunner(lambda v: v, [], device="cpu", capture_sizes=[1])
    with pytest.raises(ValueError, match="give capture_sizes or max_bs"):
        EagerRunner(lambda v: v, decode_buffer_specs(), device="cpu")
    with pytest.raises(ValueError, match="max_bs=8 disagrees with the largest capture size 4"):
        EagerRunner(
            lambda v: v, decode_buffer_specs(), device="cpu", capture_sizes=[1, 4], max_bs=8
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
    assert not runner.is_captured and runner._launchers == {}
    with pytest.raises(NotCapturedError, match="size 4 .* not captured"):
        runner.replay(world.make_batch(3, seed=0))
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
