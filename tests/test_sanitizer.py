"""Planted bugs: each disabled pad rule, and each way a padded row can touch
live state, is caught by the sanitizer on every runner."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from conftest import CapturedToy
from graphrunner import BufferSpec, GraphRunner, PadRule, create_runner, decode_buffer_specs
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.pools import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from graphrunner.sanitizer.padding import PaddingSanitizer, PaddingViolation
from graphrunner.testing import ToyWorld
from graphrunner.writers.base import write_sources
from poison import stale_values

RAW_BS = 5  # padded to 8


def sanitized_eager(world: ToyWorld, forward: object, specs: list[BufferSpec] | None = None):
    """A captured eager runner over ``world`` with the sanitizer on."""
    runner = create_runner(
        forward,  # type: ignore[arg-type]
        specs or decode_buffer_specs(),
        device="cpu",
        capture_sizes=[8],
        show_progress=False,
        sanitizer=PaddingSanitizer.for_pools(world.req_pool, world.kv),
        kind="eager",
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

    bufs = sanitized.runner.buffers

    def populate_forgetting_one_rule(sources: list, raw_bs: int, bs: int) -> int:
        ops = write_sources(bufs, sources, raw_bs, bs)
        bufs.tensors[field][raw_bs:bs].fill_(stale)  # the rule "was never applied"
        return ops

    # The replay path's writer (the runner's torch writer, after validation).
    monkeypatch.setattr(sanitized.runner.writer, "write", populate_forgetting_one_rule)
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
    with pytest.raises(PaddingViolation, match=f"k_cache\\[0\\] KV slot {live_slot} changed"):
        runner.replay(batch)


def test_write_to_padding_row_of_req_to_token_is_caught():
    world = ToyWorld()

    def forward_that_writes_row_zero(b: object) -> torch.Tensor:
        world.req_pool.req_to_token[b.req_pool_indices] = 3  # type: ignore[attr-defined]
        return world.model(b)

    runner = sanitized_eager(world, forward_that_writes_row_zero)
    with pytest.raises(PaddingViolation, match="req_to_token request row 0 changed during replay"):
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
    with pytest.raises(PaddingViolation, match="batch row 1 is not finite"):
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
        pytest.raises(
            PaddingViolation, match=f"k_cache\\[0\\] KV slot {world.kv_alloc.size} changed"
        ),
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
        PaddingViolation, match=r"v_cache\[0\] KV slot \d+ changed .*element 1: 0.0 -> 2.5"
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
        PaddingViolation, match=f"req_to_token request row {row} changed .* the step only reads"
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
    with pytest.raises(PaddingViolation, match="k_cache\\[0\\] KV slot 3 changed"):
        check.after_launch(torch.zeros(2, 3))


# --- Live index values: each bad value is caught before launch ------------------


def _set(batch: DecodeBatch, field: str, row: int, value: int) -> None:
    """Plant ``value`` in ``batch.<field>[row]`` on a copy (fields may alias)."""
    t = getattr(batch, field).clone()
    t[row] = value
    setattr(batch, field, t)


def _bystander_slot(world: ToyWorld, batch: DecodeBatch) -> int:
    """A cached KV slot of a request outside the batch (allocated, not the row's)."""
    live = set(batch.req_pool_indices_cpu.tolist())
    req = next(r for r in world.slots_of if r not in live)
    return world.slots_of[req][0]


def _freed_row(world: ToyWorld, batch: DecodeBatch) -> int:
    live = set(batch.req_pool_indices_cpu.tolist())
    req = next(r for r in world.slots_of if r not in live)
    world.release(req)  # a bystander finishes: its row is free
    return req


def _row0_req(batch: DecodeBatch) -> int:
    return int(batch.req_pool_indices_cpu[0])


Plant = Callable[[ToyWorld, DecodeBatch], None]

#: (name, plant on batch row 1, the message it must raise)
BAD_VALUES: list[tuple[str, Plant, str]] = [
    (
        "out_cache_loc -1",
        lambda w, b: _set(b, "out_cache_loc", 1, -1),
        r"out_cache_loc batch row 1 = -1: expected an allocated KV slot",
    ),
    (
        "out_cache_loc 0",
        lambda w, b: _set(b, "out_cache_loc", 1, 0),
        r"out_cache_loc batch row 1 = 0: expected a live KV slot, not the padding slot 0",
    ),
    (
        "out_cache_loc past the cache",
        lambda w, b: _set(b, "out_cache_loc", 1, w.kv_alloc.size + 1),
        r"out_cache_loc batch row 1 = 2049: expected an allocated KV slot",
    ),
    (
        "out_cache_loc freed",
        lambda w, b: _set(b, "out_cache_loc", 1, w.kv_alloc.size),
        r"out_cache_loc batch row 1 = 2048: expected an allocated KV slot",
    ),
    (
        "out_cache_loc of another request",
        lambda w, b: _set(b, "out_cache_loc", 1, _bystander_slot(w, b)),
        r"out_cache_loc batch row 1 \(request row \d+\) = \d+: expected KV slot \d+ "
        r"\(req_to_token\[\d+, \d+\]\), the one its request owns",
    ),
    (
        "out_cache_loc twice",
        lambda w, b: _set(b, "out_cache_loc", 1, int(b.out_cache_loc[0])),
        r"out_cache_loc batch row 1 = \d+: expected each KV slot once \(batch row 0 has it too\)",
    ),
    (
        "req_pool_indices 0",
        lambda w, b: _set(b, "req_pool_indices", 1, 0),
        r"req_pool_indices batch row 1 = 0: expected a live request row, not the padding row 0",
    ),
    (
        "req_pool_indices -1",
        lambda w, b: _set(b, "req_pool_indices", 1, -1),
        r"req_pool_indices batch row 1 = -1: expected a request row in 1\.\.24",
    ),
    (
        "req_pool_indices past the pool",
        lambda w, b: _set(b, "req_pool_indices", 1, 25),
        r"req_pool_indices batch row 1 = 25: expected a request row in 1\.\.24",
    ),
    (
        "req_pool_indices freed",
        lambda w, b: _set(b, "req_pool_indices", 1, _freed_row(w, b)),
        r"req_pool_indices batch row 1 = \d+: expected an allocated request row",
    ),
    (
        "req_pool_indices twice",
        lambda w, b: _set(b, "req_pool_indices", 1, _row0_req(b)),
        r"req_pool_indices batch row 1 = \d+: expected each request row once \(batch row 0",
    ),
    (
        "req_pool_indices != mirror",
        lambda w, b: setattr(b, "req_pool_indices", b.req_pool_indices.flip(0).clone()),
        r"req_pool_indices batch row 0 = \d+: expected \d+, its host mirror req_pool_indices_cpu\[0\]",
    ),
    (
        "positions != seq_lens - 1",
        lambda w, b: _set(b, "positions", 1, int(b.positions[1]) - 1),
        r"positions batch row 1 = \d+: expected seq_lens - 1 = \d+",
    ),
    (
        "positions -1",
        lambda w, b: _set(b, "positions", 1, -1),
        r"positions batch row 1 = -1: expected seq_lens - 1 = \d+",
    ),
    (
        "seq_lens != mirror",
        lambda w, b: _set(b, "seq_lens", 1, int(b.seq_lens_cpu[1]) + 1),
        r"seq_lens batch row 1 = \d+: expected \d+, its host mirror seq_lens_cpu\[1\]",
    ),
    (
        "seq_lens past the width",
        lambda w, b: (_set(b, "seq_lens", 1, 65), _set(b, "seq_lens_cpu", 1, 65)),
        r"seq_lens batch row 1 = 65: expected 1\.\.64",
    ),
    (
        # Zero on a live row, with its mirror and its position consistent with it
        # (positions = seq_lens - 1 = -1 would be caught on its own: keep it 0 here).
        "seq_lens 0 on a live row",
        lambda w, b: (_set(b, "seq_lens", 1, 0), _set(b, "seq_lens_cpu", 1, 0)),
        r"seq_lens batch row 1 = 0: expected 1\.\.64",
    ),
]


class CountingForward:
    """The toy forward, counting its calls (a violation must come before any)."""

    def __init__(self, world: ToyWorld) -> None:
        self.world, self.calls = world, 0

    def __call__(self, b: object) -> torch.Tensor:
        self.calls += 1
        return self.world.model(b)


def value_checked_runner(world: ToyWorld, forward: CountingForward) -> GraphRunner:
    sanitizer = PaddingSanitizer.for_pools(world.req_pool, world.kv, kv_allocator=world.kv_alloc)
    runner = create_runner(
        forward,  # type: ignore[arg-type]
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[4, 8],
        sanitizer=sanitizer,
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    return runner


def replay_quietly(runner: GraphRunner, batch: DecodeBatch) -> torch.Tensor:
    with warnings.catch_warnings():  # the eager fallback's warning is not under test
        warnings.simplefilter("ignore", RuntimeWarning)
        return runner.replay(batch)


@pytest.mark.parametrize("raw_bs", [RAW_BS, 10], ids=["graph", "eager-fallback"])
@pytest.mark.parametrize(
    ("plant", "message"), [p[1:] for p in BAD_VALUES], ids=[p[0] for p in BAD_VALUES]
)
def test_bad_live_value_is_caught_before_launch(plant: Plant, message: str, raw_bs: int):
    world = ToyWorld()
    forward = CountingForward(world)
    runner = value_checked_runner(world, forward)
    batch = world.make_batch(raw_bs, seed=10)
    replay_quietly(runner, batch)  # the batch as prepared is fine
    batch = world.make_batch(raw_bs, seed=10)
    plant(world, batch)
    before, calls = world.state(), forward.calls
    with pytest.raises(PaddingViolation, match=message):
        replay_quietly(runner, batch)
    assert forward.calls == calls, "the forward ran with a bad index"
    after = world.state()
    for name, tensor in before.items():  # no slot was written, the last one included
        assert torch.equal(after[name], tensor), name


def test_negative_writer_does_not_exempt_the_last_row():
    """A -1 writer that reaches the state check (planted after the snapshot)
    is a violation itself; it never exempts the last KV row it wrapped onto."""
    world = ToyWorld()
    batch = world.make_batch(RAW_BS, seed=11)
    sanitizer = PaddingSanitizer.for_pools(world.req_pool, world.kv, kv_allocator=world.kv_alloc)
    check = sanitizer.snapshot(batch)
    batch.out_cache_loc = batch.out_cache_loc.clone()
    batch.out_cache_loc[1] = -1
    world.kv.k_buffers[0][-1] += 1.0  # the write a -1 makes
    with pytest.raises(
        PaddingViolation,
        match=r"out_cache_loc batch row 1 = -1: expected a row of k_cache\[0\] in 0\.\.2048",
    ):
        check.after_launch(torch.zeros(RAW_BS, 3))


def test_writer_outside_the_state_is_caught_without_live_values():
    """Inputs without a batch size skip the value checks, never the writer range."""
    req_pool = ReqToTokenPool(2, 8, "cpu")
    kv = KVCache(16, 1, 1, 2, torch.float32, "cpu")
    sanitizer = PaddingSanitizer.for_pools(req_pool, kv)
    with pytest.raises(
        PaddingViolation,
        match=r"out_cache_loc batch row 1 = 17: expected a row of k_cache\[0\] in 0\.\.16",
    ):
        sanitizer.snapshot(SimpleNamespace(out_cache_loc=torch.tensor([3, 17])))


def test_checks_skip_fields_of_another_phase():
    """A speculative phase's inputs have several rows per request, or lack
    fields: the checks that need them are skipped, nothing crashes."""
    req_pool = ReqToTokenPool(4, 8, "cpu")
    kv = KVCache(16, 1, 1, 2, torch.float32, "cpu")
    (req,) = req_pool.alloc(1)
    sanitizer = PaddingSanitizer.for_pools(req_pool, kv)
    inputs = SimpleNamespace(
        batch_size=1,
        req_pool_indices=torch.tensor([req]),
        out_cache_loc=torch.tensor([5, 6, 7]),  # 3 draft tokens for the one request
        positions=torch.tensor([2, 3, 4]),
    )
    sanitizer.snapshot(inputs).after_launch(torch.zeros(1, 3))
    inputs.req_pool_indices = torch.tensor([0])  # the fields it has are still checked
    with pytest.raises(PaddingViolation, match="req_pool_indices batch row 0 = 0"):
        sanitizer.snapshot(inputs)


def test_paged_slot_inside_the_rows_page_is_owned():
    """With pages of 4 slots the new token's slot is inside the row's last
    page, and still the one req_to_token records at its position."""
    req_pool = ReqToTokenPool(4, 16, "cpu")
    alloc = TokenToKVPoolAllocator(32, "cpu", page_size=4)
    kv = KVCache(32, 1, 1, 2, torch.float32, "cpu", page_size=4)
    sanitizer = PaddingSanitizer.for_pools(req_pool, kv, kv_allocator=alloc)
    (req,) = req_pool.alloc(1)
    pages = alloc.alloc(4)
    req_pool.write(req, 0, pages[:2])
    batch = DecodeBatch.from_requests(
        [req], [2], torch.tensor([1]), device="cpu", max_context_len=16
    )
    batch.prepare_decode(req_pool, alloc)
    assert batch.out_cache_loc.tolist() == [pages[2]]
    sanitizer.snapshot(batch).after_launch(torch.zeros(1, 3))
    _set(batch, "out_cache_loc", 0, pages[3])  # allocated, same page, not its slot
    with pytest.raises(
        PaddingViolation,
        match=rf"out_cache_loc batch row 0 \(request row \d+\) = {pages[3]}: expected KV slot",
    ):
        sanitizer.snapshot(batch)


@pytest.mark.parametrize("field", ["out_cache_loc", "req_pool_indices", "positions"])
def test_negative_index_is_caught_on_every_runner(sanitized: CapturedToy, field: str):
    """A compiled program does not bounds-check: a -1 wraps onto the last row
    (the last KV slot, maybe another request's). Caught before launch, on
    every mechanism, with nothing written."""
    world = sanitized.world
    batch = world.make_batch(RAW_BS, seed=12)
    _set(batch, field, 1, -1)
    before = world.state()
    with pytest.raises(PaddingViolation, match=f"{field} batch row 1 = -1: expected"):
        sanitized.runner.replay(batch)
    after = world.state()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
