"""The sanitizer's value checks follow each buffer's index declaration, so
target verify, EAGLE draft extend and frozen-KV MTP replays get the checks
decode gets: a bad value planted in each phase's inputs is named before any
state is written; token ids outside the vocabulary are named when the
sanitizer knows its size."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from graphrunner import GraphRunner, create_runner
from graphrunner.declare.buffers import BufferSpec, Index, PadRule
from graphrunner.phases import (
    EagleDraftExtendRunner,
    FrozenKvMtpRunner,
    SpecBatch,
    frozen_kv_sanitizer,
    verify_phase,
)
from graphrunner.sanitizer.padding import PaddingSanitizer, PaddingViolation
from spec_world import SpecWorld

W = 3
RAW_BS = 2


def _runner(
    world: SpecWorld, phase: str, vocab_size: int | None = None, sizes: tuple[int, ...] = (4,)
) -> GraphRunner:
    b = world.bundle
    common: dict[str, Any] = {
        "device": world.device,
        "capture_sizes": list(sizes),
        "show_progress": False,
        "kind": "eager",
    }
    if phase == "mtp":
        sanitizer = frozen_kv_sanitizer(b.req_pool, b.kv_cache, vocab_size=vocab_size)
        runner: GraphRunner = FrozenKvMtpRunner(world.mtp, sanitizer=sanitizer, **common)
    else:
        kv = world.draft_kv if phase == "eagle" else b.kv_cache
        sanitizer = PaddingSanitizer.for_pools(
            b.req_pool, kv, kv_allocator=b.kv_alloc, vocab_size=vocab_size
        )
        if phase == "verify":
            runner = create_runner(verify_phase(world.model, W), sanitizer=sanitizer, **common)
        else:
            runner = EagleDraftExtendRunner(world.eagle, W, sanitizer=sanitizer, **common)
    runner.capture()
    return runner


def _inputs(world: SpecWorld, phase: str, seed: int) -> SpecBatch:
    requests = world.reset(RAW_BS, seed)
    if phase == "verify":
        return world.verify_inputs(requests, W, seed)
    if phase == "eagle":
        return world.eagle_inputs(requests, W, seed)
    return world.mtp_inputs(requests, seed)


def _set(
    inputs: SpecBatch, field: str, row: int, value: int | Callable[[torch.Tensor], int]
) -> None:
    t = getattr(inputs, field).clone()
    t[row] = value(t) if callable(value) else value
    setattr(inputs, field, t)


def _bystander_slot(world: SpecWorld) -> int:
    # reset() prefills two bystanders first: request row 1 holds their first slots.
    return int(world.bundle.req_pool.req_to_token[1, 0])


#: (phase, field, row, value or function of the tensor, the message it must raise)
PLANTS: list[tuple[str, str, int, Any, str]] = [
    ("verify", "out_cache_loc", 4, 0, r"out_cache_loc batch row 4 = 0: expected a live KV slot"),
    (
        "verify",
        "out_cache_loc",
        5,
        lambda t: int(t[0]),
        r"out_cache_loc batch row 5 = \d+: expected each KV slot once \(batch row 0",
    ),
    (
        "verify",
        "positions",
        4,
        lambda t: int(t[4]) + 1,
        r"positions batch row 4 = \d+: expected seq_lens - 2 = \d+",
    ),
    (
        "verify",
        "req_pool_indices",
        1,
        0,
        r"req_pool_indices batch row 1 = 0: expected a live request row",
    ),
    ("eagle", "accept_lens", 1, 0, r"accept_lens batch row 1 = 0: expected a count in 1\.\.3"),
    ("eagle", "accept_lens", 0, W + 1, r"accept_lens batch row 0 = 4: expected a count in 1\.\.3"),
    ("eagle", "extend_lens", 0, W + 1, r"extend_lens batch row 0 = 4: expected a count in 1\.\.3"),
    ("eagle", "out_cache_loc", 2, -1, r"out_cache_loc batch row 2 = -1: expected an allocated"),
    (
        "eagle",
        "positions",
        3,
        lambda t: int(t[3]) - 1,
        r"positions batch row 3 = \d+: expected seq_lens - 3 = \d+",
    ),
    (
        "mtp",
        "positions",
        1,
        lambda t: int(t[1]) + 1,
        r"positions batch row 1 = \d+: expected seq_lens - 1 = \d+",
    ),
    (
        "mtp",
        "req_pool_indices",
        0,
        -1,
        r"req_pool_indices batch row 0 = -1: expected a request row in 1\.\.",
    ),
]


@pytest.mark.parametrize(
    ("phase", "field", "row", "value", "message"),
    PLANTS,
    ids=[f"{p[0]}-{p[1]}-{p[2]}" for p in PLANTS],
)
def test_a_bad_value_in_each_phase_is_named_before_launch(
    phase: str, field: str, row: int, value: Any, message: str
) -> None:
    world = SpecWorld()
    runner = _runner(world, phase)
    runner.replay(_inputs(world, phase, seed=5))  # the inputs as made are fine
    inputs = _inputs(world, phase, seed=5)
    _set(inputs, field, row, value)
    before = world.state()
    with pytest.raises(PaddingViolation, match=message):
        runner.replay(inputs)
    after = world.state()
    for name, tensor in before.items():  # nothing was written
        assert torch.equal(after[name], tensor), name


@pytest.mark.parametrize(
    ("phase", "field", "row", "value", "message"),
    [p for p in PLANTS if p[1] in ("accept_lens", "positions")],
    ids=[f"{p[0]}-{p[1]}-{p[2]}" for p in PLANTS if p[1] in ("accept_lens", "positions")],
)
def test_the_eager_fallback_checks_each_phase_s_own_fields(
    phase: str, field: str, row: int, value: Any, message: str
) -> None:
    # Graphs of one request only: the two live requests run eagerly, where the
    # checks must follow the phase's declarations as a replay's do.
    world = SpecWorld()
    runner = _runner(world, phase, sizes=(1,))
    inputs = _inputs(world, phase, seed=5)
    _set(inputs, field, row, value)
    with (
        pytest.warns(RuntimeWarning, match="running it eagerly"),
        pytest.raises(PaddingViolation, match=message),
    ):
        runner.replay(inputs)


def test_a_slot_of_another_request_is_named_in_verify() -> None:
    world = SpecWorld()
    runner = _runner(world, "verify")
    inputs = _inputs(world, "verify", seed=6)
    _set(inputs, "out_cache_loc", 3, _bystander_slot(world))
    with pytest.raises(
        PaddingViolation,
        match=r"out_cache_loc batch row 3 \(request row \d+\) = \d+: expected KV slot \d+ \(req_to",
    ):
        runner.replay(inputs)


@pytest.mark.parametrize("phase", ["verify", "eagle", "mtp"])
def test_a_token_outside_the_vocabulary_is_named(phase: str) -> None:
    world = SpecWorld()
    vocab = world.model.config.vocab_size
    runner = _runner(world, phase, vocab_size=vocab)
    runner.replay(_inputs(world, phase, seed=7))
    inputs = _inputs(world, phase, seed=7)
    _set(inputs, "input_ids", 1, vocab)
    with pytest.raises(
        PaddingViolation,
        match=rf"input_ids batch row 1 = {vocab}: expected a token id in 0\.\.{vocab - 1}",
    ):
        runner.replay(inputs)


def test_without_a_vocabulary_token_ids_are_not_bounded() -> None:
    world = SpecWorld()
    runner = _runner(world, "mtp")
    inputs = _inputs(world, "mtp", seed=8)
    _set(inputs, "input_ids", 0, world.model.config.vocab_size - 1)
    runner.replay(inputs)


def test_count_declarations_need_the_width_rule() -> None:
    not_an_index: Any = "count"
    with pytest.raises(ValueError, match=r"indexes=Index.COUNT with rule=ZERO"):
        BufferSpec("accept_lens", torch.int64, PadRule.ZERO, indexes=Index.COUNT)
    with pytest.raises(ValueError, match=r"indexes='count'; expected an Index or None"):
        BufferSpec("accept_lens", torch.int64, PadRule.ZERO, indexes=not_an_index)


@pytest.mark.parametrize("bad", [0, -3, True, 2.5])
def test_vocab_size_is_checked_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"vocab_size=.*expected an int >= 1 or None"):
        PaddingSanitizer(vocab_size=bad)


def test_a_live_mamba_slot_0_is_named_by_its_declaration() -> None:
    sanitizer = PaddingSanitizer()
    inputs = SimpleNamespace(batch_size=2, mamba_track_indices=torch.tensor([3, 0]))
    with pytest.raises(
        PaddingViolation, match=r"mamba_track_indices batch row 1 = 0: expected a live Mamba slot"
    ):
        sanitizer.snapshot(inputs)


def test_undeclared_fields_are_not_checked() -> None:
    """Only what a buffer declares it indexes is checked: the same planted 0
    in a buffer without a declaration passes."""
    plain = BufferSpec("mamba_track_indices", torch.int64, PadRule.ZERO, index=True)
    inputs = SimpleNamespace(batch_size=2, mamba_track_indices=torch.tensor([3, 0]))
    PaddingSanitizer().snapshot(inputs, specs=[plain]).after_launch(torch.zeros(2))
