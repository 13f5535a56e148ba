"""The four runners known by name are ``create_runner`` with one argument
fixed, and nothing else: the same phase, the same mechanism, the same
graphs and the same outputs as the constructor they bind."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conftest import HAS_CUDA
from graphrunner import (
    CpuGraphRunner,
    CudaGraphRunner,
    EagleDraftExtendRunner,
    FrozenKvMtpRunner,
    GraphRunner,
    create_runner,
    decode_buffer_specs,
)
from graphrunner.phases import eagle_draft_extend_phase, frozen_kv_mtp_phase
from graphrunner.testing import ToyWorld
from spec_world import SpecWorld

COMMON: dict[str, Any] = {"capture_sizes": [2, 4], "show_progress": False}


def _same_runner(named: GraphRunner, built: GraphRunner) -> None:
    assert type(named.mechanism) is type(built.mechanism) and named.kind == built.kind
    assert named.buffers.specs == built.buffers.specs and named.width == built.width
    assert named.capture_sizes == built.capture_sizes


@pytest.mark.parametrize(
    ("binding", "kind"),
    [
        (CpuGraphRunner, "cpu"),
        pytest.param(
            CudaGraphRunner,
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")],
        ),
    ],
)
def test_a_mechanism_binding_is_create_runner_with_its_kind(binding: type, kind: str) -> None:
    device = "cuda" if kind == "cuda" else "cpu"
    world = ToyWorld(device)
    named = binding(world.model, decode_buffer_specs(), device=device, **COMMON)
    built = create_runner(world.model, decode_buffer_specs(), kind=kind, device=device, **COMMON)
    _same_runner(named, built)
    batch = world.make_batch(3, seed=2)
    state = world.state()
    named.capture()
    out = named.replay(batch).clone()
    world.restore(state)
    built.capture()
    torch.testing.assert_close(out, built.replay(batch), rtol=0, atol=0)
    assert named.graph_keys == built.graph_keys
    with pytest.raises(TypeError, match=f"this runner fixes kind='{kind}'"):
        binding(world.model, decode_buffer_specs(), kind="eager", device=device, **COMMON)


@pytest.mark.parametrize("phase_name", ["eagle_extend", "mtp"])
def test_a_phase_binding_is_create_runner_with_its_phase(phase_name: str) -> None:
    world = SpecWorld()
    requests = world.reset(3, seed=4)
    opts = {"kind": "eager", "device": world.device, **COMMON}
    if phase_name == "eagle_extend":
        named: GraphRunner = EagleDraftExtendRunner(world.eagle, 2, **opts)
        built = create_runner(eagle_draft_extend_phase(world.eagle, 2), **opts)
        inputs = world.eagle_inputs(requests, 2, seed=4)
    else:
        named = FrozenKvMtpRunner(world.mtp, **opts)
        built = create_runner(frozen_kv_mtp_phase(world.mtp), **opts)
        inputs = world.mtp_inputs(requests, seed=4)
    _same_runner(named, built)
    state = world.state()
    named.capture()
    first = {k: v.clone() for k, v in named.replay(inputs).items()}
    world.restore(state)
    built.capture()
    second = built.replay(inputs)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
