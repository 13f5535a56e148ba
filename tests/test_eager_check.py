"""check_against_eager: the eager forward from the state as it was, the
replay from the same state; outputs and every state row compared. A stray
write of the replay is found even where the eager call would have written
the same row first (the pattern it replaces hid it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import RUNNER_PARAMS, make_runner
from graphrunner import PaddingViolation, decode_buffer_specs
from graphrunner.sanitizer import check_against_eager
from graphrunner.testing import ToyWorld


def _state(world: ToyWorld) -> list[torch.Tensor]:
    return [*world.kv.get_kv(0), world.req_pool.req_to_token]


@pytest.mark.parametrize("kind", RUNNER_PARAMS)
def test_a_correct_replay_equals_eager(kind: str) -> None:
    world = ToyWorld("cuda" if kind.startswith("cuda") else "cpu")
    runner = make_runner(kind, world.model, decode_buffer_specs(), capture_sizes=[4])
    runner.capture()
    result = check_against_eager(runner, world.make_batch(3, seed=0), _state(world))
    assert result.ok, result.format()
    assert result.format().startswith("replay equals eager")


def test_a_stray_write_of_the_replay_is_reported_by_state_and_row() -> None:
    world = ToyWorld()
    model = world.model

    def stray(b: Any) -> torch.Tensor:
        out = model.forward(b)
        k, _ = model.kv.get_kv(0)
        k[b.out_cache_loc + 1] += 1.0  # the slot after each row's: a padded row's too
        return out

    runner = make_runner("eager", stray, decode_buffer_specs(), capture_sizes=[4])
    runner.capture()
    batch = world.make_batch(3, seed=0)
    result = check_against_eager(runner, batch, _state(world), forward=model.forward)
    assert not result.ok
    assert result.state_rows and {name for name, _ in result.state_rows} == {"state[0]"}
    assert not result.mismatched_outputs  # the outputs alone would have said nothing
    with pytest.raises(PaddingViolation, match=r"state\[0\] row \d+: differs"):
        result.raise_if_any()


def test_an_output_that_differs_is_named_by_row() -> None:
    world = ToyWorld()
    runner = make_runner("eager", world.model, decode_buffer_specs(), capture_sizes=[4])
    runner.capture()

    def off(b: Any) -> torch.Tensor:
        out = world.model.forward(b)
        out[1] += 1.0
        return out

    result = check_against_eager(runner, world.make_batch(3, seed=1), _state(world), forward=off)
    assert result.mismatched_outputs == [("output", 1)]
