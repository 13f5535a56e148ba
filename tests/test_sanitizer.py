"""Planted bugs: each disabled pad rule, and each way a padded row can touch
live state, is caught by the sanitizer on every runner."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

import graphrunner.replay
from conftest import CapturedToy
from graphrunner import BufferSpec, EagerRunner, PadRule, StaticBuffers, decode_buffer_specs
from graphrunner.pools import KVCache, ReqToTokenPool
from graphrunner.populate import populate
from graphrunner.sanitizer import PaddingSanitizer, PaddingViolation
from graphrunner.testing import ToyWorld
from poison import stale_values

RAW_BS = 5  # padded to 8


def sanitized_eager(world: ToyWorld, forward: object, specs: list[BufferSpec] | None = None):
    """A captured eager runner over ``world`` with the sanitizer on."""
    runner = EagerRunner(
        forward,  # type: ignore[arg-type]
        specs or decode_buffer_specs(),
        device="cpu",
        capture_sizes=[8],
        show_progress=False,
        sanitizer=PaddingSanitizer.for_pools(world.req_pool, world.kv),
    )
    runner.capture()
    return runner


@pytest.fixture
def sanitized(captured_toy: CapturedToy) -> Iterator[CapturedToy]:
    world = captured_toy.world
    captured_toy.runner.sanitizer = PaddingSanitizer.for_pools(
        world.req_pool, world.kv, kv_allocator=world.kv_alloc
    )
    yield captured_toy
    captured_toy.runner.sanitizer = None


def test_correct_replay_passes_and_reports_cost(sanitized: CapturedToy):
    sanitized.runner.replay(sanitized.world.make_batch(RAW_BS, seed=0))
    stats = sanitized.runner.sanitizer.stats  # type: ignore[union-attr]
    assert stats.replays_checked == 1 and stats.seconds > 0


@pytest.mark.parametrize("field", [s.name for s in decode_buffer_specs()])
def test_disabled_pad_rule_is_caught(
    sanitized: CapturedToy, field: str, monkeypatch: pytest.MonkeyPatch
):
    world = sanitized.world
    batch = world.make_batch(RAW_BS, seed=1)
    stale = stale_values(world, batch)[field]

    def populate_forgetting_one_rule(bufs: StaticBuffers, inputs: object, raw_bs: int, bs: int):
        ops = populate(bufs, inputs, raw_bs, bs)
        bufs.tensors[field][raw_bs:bs].fill_(stale)  # the rule "was never applied"
        return ops

    monkeypatch.setattr(graphrunner.replay, "populate", populate_forgetting_one_rule)
    with pytest.raises(PaddingViolation, match=f"buffer '{field}' padded row {RAW_BS} .* holds"):
        sanitized.runner.replay(batch)


def test_pad_value_pointing_at_live_kv_is_caught():
    """A wrongly declared rule passes the tail check; the state check catches
    the padded row writing a live request's KV slot."""
    world = ToyWorld()
    batch = world.make_batch(RAW_BS, seed=2)
    live_slot = stale_values(world, batch)["out_cache_loc"]
    specs = [
        BufferSpec("out_cache_loc", torch.int64, PadRule.FILL, fill_value=live_slot)
        if s.name == "out_cache_loc"
        else s
        for s in decode_buffer_specs()
    ]
    runner = sanitized_eager(world, world.model, specs)
    batch = world.make_batch(RAW_BS, seed=2)  # fresh state after capture's dummy writes
    with pytest.raises(PaddingViolation, match=f"k_cache\\[0\\] row {live_slot} changed"):
        runner.replay(batch)


def test_write_to_padding_row_of_req_to_token_is_caught():
    world = ToyWorld()

    def forward_that_writes_row_zero(b: object) -> torch.Tensor:
        world.req_pool.req_to_token[b.req_pool_indices] = 3  # type: ignore[attr-defined]
        return world.model(b)

    runner = sanitized_eager(world, forward_that_writes_row_zero)
    with pytest.raises(PaddingViolation, match="req_to_token row 0 changed during replay"):
        runner.replay(world.make_batch(RAW_BS, seed=3))
    batch = world.make_batch(RAW_BS, seed=3)
    world.req_pool.req_to_token[0, 5] = 9  # and a dirty row 0 is caught before launch
    with pytest.raises(PaddingViolation, match="row 0 .* column 5 holds 9"):
        runner.replay(batch)


def test_pool_handing_out_slot_zero_is_caught(
    sanitized: CapturedToy, monkeypatch: pytest.MonkeyPatch
):
    alloc = sanitized.world.kv_alloc
    batch = sanitized.world.make_batch(RAW_BS, seed=4)
    monkeypatch.setattr(alloc, "is_allocated", lambda slot: True)
    with pytest.raises(PaddingViolation, match="TokenToKVPoolAllocator handed out .* slot 0"):
        sanitized.runner.replay(batch)


def test_non_finite_live_output_is_caught():
    world = ToyWorld()

    def forward_with_nan(b: object) -> torch.Tensor:
        out = world.model(b)
        return torch.where(b.input_ids[:, None] == b.input_ids[1], torch.nan, out)  # type: ignore[attr-defined]

    runner = sanitized_eager(world, forward_with_nan)
    with pytest.raises(PaddingViolation, match="live row 1 is not finite"):
        runner.replay(world.make_batch(RAW_BS, seed=5))


def test_eager_fallback_is_checked_too():
    """A batch above the largest graph runs eagerly, under the same state and
    output checks."""
    world = ToyWorld()

    def forward_with_stray_write(b: object) -> torch.Tensor:
        world.kv.k_buffers[0][world.kv_alloc.size] += 1.0  # a slot no live row owns
        return world.model(b)

    runner = sanitized_eager(world, forward_with_stray_write)
    batch = world.make_batch(10, seed=6)  # above the one captured size, 8
    with (
        pytest.warns(RuntimeWarning, match="batch size 10 is above the largest captured size 8"),
        pytest.raises(PaddingViolation, match=f"k_cache\\[0\\] row {world.kv_alloc.size} changed"),
    ):
        runner.replay(batch)
    # A step that raised is not counted, as a failed graph replay is not.
    assert runner.stats.eager_fallbacks == 0


def test_violation_names_the_old_and_new_value():
    world = ToyWorld()
    slot = world.kv_alloc.size

    def forward_with_stray_write(b: object) -> torch.Tensor:
        world.kv.v_buffers[0][slot, 0, 1] = 2.5
        return world.model(b)

    runner = sanitized_eager(world, forward_with_stray_write)
    batch = world.make_batch(RAW_BS, seed=7)
    world.kv.v_buffers[0][slot] = 0.0
    with pytest.raises(
        PaddingViolation, match=r"v_cache\[0\] row \d+ changed .*element 1: 0.0 -> 2.5"
    ):
        runner.replay(batch)


def test_a_nan_nothing_wrote_is_not_a_change():
    """NaN != NaN: state that holds a NaN before and after replay is unchanged."""
    world = ToyWorld()
    runner = sanitized_eager(world, world.model)
    batch = world.make_batch(RAW_BS, seed=8)
    world.kv.k_buffers[0][world.kv_alloc.size, 0, 0] = float("nan")  # nobody's slot
    runner.replay(batch)
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked == 1


def test_req_to_token_is_read_only_unless_a_writer_is_declared():
    """A decode step never writes req_to_token: a live row rewriting its own
    history is caught, unless the forward declares it assigns slots itself."""
    world = ToyWorld()

    def forward_rewriting_history(b: object) -> torch.Tensor:
        world.req_pool.req_to_token[b.req_pool_indices[:1], 0] += 1  # type: ignore[attr-defined]
        return world.model(b)

    runner = sanitized_eager(world, forward_rewriting_history)
    batch = world.make_batch(RAW_BS, seed=9)
    row = int(batch.req_pool_indices_cpu[0])
    with pytest.raises(
        PaddingViolation, match=f"req_to_token row {row} changed .* the step only reads"
    ):
        runner.replay(batch)
    runner.sanitizer = PaddingSanitizer.for_pools(
        world.req_pool, world.kv, req_to_token_writer="req_pool_indices"
    )
    runner.replay(world.make_batch(RAW_BS, seed=9))


def test_paged_cache_sink_is_slot_0_only():
    """Padded rows write slot 0; the rest of the padding page is nobody's."""
    req_pool = ReqToTokenPool(2, 8, "cpu")
    kv = KVCache(16, 1, 1, 2, torch.float32, "cpu", page_size=4)
    sanitizer = PaddingSanitizer.for_pools(req_pool, kv)
    inputs = SimpleNamespace(out_cache_loc=torch.tensor([0, 0]))
    check = sanitizer.snapshot(inputs)
    kv.k_buffers[0][0] += 1.0  # the sink: fine
    check.after_launch(torch.zeros(2, 3))
    check = sanitizer.snapshot(inputs)
    kv.k_buffers[0][3] += 1.0  # same padding page, not the sink
    with pytest.raises(PaddingViolation, match="k_cache\\[0\\] row 3 changed"):
        check.after_launch(torch.zeros(2, 3))
