"""Captured-state identity: under the sanitizer a replay refuses a tensor the
captured forward reads that was reassigned after capture (the graph or the
compiled program would go on reading the old one, silently), naming its
attribute path; an in-place update passes and is read."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import RUNNER_PARAMS, make_runner
from graphrunner import PaddingSanitizer, PaddingViolation, decode_buffer_specs
from graphrunner.sanitizer import CapturedState
from graphrunner.testing import ToyWorld


class Scaled(torch.nn.Module):
    """The toy model's logits times a tensor attribute and a linear's weight."""

    def __init__(self, world: ToyWorld) -> None:
        super().__init__()
        self.world = world
        self.scale = torch.tensor(2.0, device=world.device)
        vocab = world.cfg.vocab
        self.mix = torch.nn.Linear(vocab, vocab, bias=False, device=world.device)
        torch.nn.init.eye_(self.mix.weight)

    def forward(self, b: Any) -> torch.Tensor:
        return self.mix(self.world.model.forward(b)) * self.scale


def _sanitized(kind: str) -> tuple[ToyWorld, Scaled, Any]:
    world = ToyWorld("cuda" if kind.startswith("cuda") else "cpu")
    model = Scaled(world)
    runner = make_runner(kind, model.forward, decode_buffer_specs(), capture_sizes=[4])
    runner.capture()
    runner.sanitizer = PaddingSanitizer.for_pools(
        world.req_pool, world.kv, kv_allocator=world.kv_alloc
    )
    return world, model, runner


@pytest.mark.parametrize("kind", RUNNER_PARAMS)
def test_a_reassigned_tensor_attribute_is_named(kind: str) -> None:
    world, model, runner = _sanitized(kind)
    runner.replay(world.make_batch(3, seed=0))  # the state as captured: passes
    model.scale = torch.tensor(3.0, device=world.device)
    with pytest.raises(PaddingViolation, match=r"captured state model\.scale was reassigned"):
        runner.replay(world.make_batch(3, seed=1))


@pytest.mark.parametrize("kind", RUNNER_PARAMS)
def test_a_replaced_parameter_is_named(kind: str) -> None:
    world, model, runner = _sanitized(kind)
    model.mix.weight = torch.nn.Parameter(model.mix.weight.detach().clone())
    with pytest.raises(PaddingViolation, match=r"model\.mix\.weight was reassigned"):
        runner.replay(world.make_batch(2, seed=0))


def test_an_in_place_update_passes_and_is_read() -> None:
    world, model, runner = _sanitized("eager")
    batch = world.make_batch(3, seed=0)
    state = world.state()
    before = runner.replay(batch).clone()
    world.restore(state)
    model.scale.copy_(torch.tensor(4.0))
    assert torch.allclose(runner.replay(batch), before * 2)


def test_the_plain_replay_does_not_check() -> None:
    world, model, runner = _sanitized("eager")
    runner.sanitizer = None
    model.scale = torch.tensor(3.0)
    runner.replay(world.make_batch(2, seed=0))  # no sanitizer, no check (the debug mode's)


def test_modules_are_found_in_closures_and_bound_methods() -> None:
    world = ToyWorld()
    model = Scaled(world)
    bound = CapturedState(model.forward)
    closed = CapturedState(lambda b: model(b))
    assert len(bound) == len(closed) == 2  # scale and mix.weight
    assert len(CapturedState(lambda b: b)) == 0
    model.scale = torch.tensor(1.0)
    with pytest.raises(PaddingViolation, match="model.scale"):
        closed.check()
