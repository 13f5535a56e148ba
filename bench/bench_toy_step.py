"""One decode step of the toy model: eager forward vs runners, same run."""

from __future__ import annotations

import pytest
import torch

from bench.conftest import record
from graphrunner import GraphRunner, create_runner, decode_buffer_specs
from graphrunner.testing import ToyWorld, ToyWorldConfig

SIZES = [1, 8, 32]
KINDS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _world(kind: str) -> ToyWorld:
    device = "cuda" if kind == "cuda" else "cpu"
    return ToyWorld(device, ToyWorldConfig(num_reqs=40, kv_slots=16384, max_context_len=256))


@pytest.fixture(scope="module", params=KINDS)
def captured(request: pytest.FixtureRequest) -> tuple[ToyWorld, GraphRunner]:
    world = _world(request.param)
    runner = create_runner(
        request.param,
        world.model,
        decode_buffer_specs(),
        device=world.device,
        capture_sizes=SIZES,
        show_progress=False,
    )
    runner.capture()
    return world, runner


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("bs", SIZES)
def bench_toy_step_eager(benchmark: object, captured: tuple[ToyWorld, GraphRunner], bs: int):
    world, runner = captured
    batch = world.make_batch(bs, seed=bs)
    benchmark(lambda: (world.model(batch), _sync(world.device)))  # type: ignore[operator]
    record(benchmark, f"toy step ({runner.kind})", bs, "eager")


@pytest.mark.parametrize("bs", SIZES)
def bench_toy_step_runner(benchmark: object, captured: tuple[ToyWorld, GraphRunner], bs: int):
    world, runner = captured
    batch = world.make_batch(bs, seed=bs)
    benchmark(lambda: (runner.replay(batch), _sync(world.device)))  # type: ignore[operator]
    record(benchmark, f"toy step ({runner.kind})", bs, runner.kind)
