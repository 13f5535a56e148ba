"""The token-batch phase: prompt chunks and decode rows in one step, padded
on two axes (tokens and requests) by the one populate, replayed at every
token count up to the largest captured one and one above, under the
sanitizer, against the eager forward of the unpadded step. Planted bugs
(a padded token writing a live request's slot, a live request reading a
padded token's K/V, a chunk attending past its own position) are refused."""

from __future__ import annotations

import random
import warnings
from typing import Any

import pytest
import torch

from graphrunner import BufferView, PaddingSanitizer, create_runner
from graphrunner.declare.buffers import Axis, StepSize
from graphrunner.phases import token_batch_inputs, token_batch_phase, token_batch_specs
from graphrunner.sanitizer import PaddingViolation
from graphrunner.sizing import default_token_sizes
from graphrunner.testing import ToyWorld

SIZES = [4, 8, 16]
MAX_REQUESTS = 4
KINDS = ["eager", "cpu"]


def _sanitizer(world: ToyWorld) -> PaddingSanitizer:
    return PaddingSanitizer.for_pools(
        world.req_pool, world.kv, kv_allocator=world.kv_alloc, vocab_size=world.cfg.vocab
    )


@pytest.fixture(scope="module", params=KINDS)
def toy(request: pytest.FixtureRequest) -> tuple[ToyWorld, Any]:
    world = ToyWorld()
    phase = token_batch_phase(world.model.forward_token_batch, max_requests=MAX_REQUESTS)
    runner = create_runner(
        phase, kind=request.param, capture_sizes=SIZES, sanitizer=_sanitizer(world),
        show_progress=False,
    )  # fmt: skip
    runner.capture()
    return world, runner


def _chunks(tokens: int, seed: int) -> list[tuple[int, int]]:
    """``tokens`` split over at most MAX_REQUESTS requests, some with a cached
    prefix (a later chunk of a prompt, or a decode row), some fresh."""
    rng = random.Random(seed)
    requests = rng.randint(1, min(tokens, MAX_REQUESTS))
    cuts = sorted(rng.sample(range(1, tokens), requests - 1)) if requests > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
    return [(rng.choice([0, rng.randint(1, 20)]), n) for n in sizes]


def _poison(runner: Any) -> None:
    """Every static buffer filled with hostile values: populate must rewrite
    each padded row with its rule, never leave one."""
    for t in runner.buffers.tensors.values():
        t.fill_(-1 if not t.is_floating_point() else float("nan"))


def _replay_against_eager(world: ToyWorld, runner: Any, chunks: list[tuple[int, int]]) -> Any:
    batch = world.make_token_batch(chunks, seed=len(chunks))
    expected, expected_state = world.eager_reference(batch, world.model.forward_token_batch)
    _poison(runner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the step above the largest size warns once
        out = runner.replay(batch)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for name, state in world.state().items():  # KV written exactly as eager wrote it
        assert torch.equal(state[1:], expected_state[name][1:]), name  # row 0: the sink
    return batch


def test_every_token_count_up_to_the_largest_and_one_above(toy: tuple[ToyWorld, Any]) -> None:
    world, runner = toy
    for tokens in range(1, SIZES[-1] + 2):
        _replay_against_eager(world, runner, _chunks(tokens, seed=tokens))
    stats = runner.stats
    assert stats.eager_fallbacks == 1  # the one step above 16 tokens, counted
    assert stats.replays == SIZES[-1]
    assert runner.sanitizer.stats.replays_checked >= SIZES[-1]


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 16)],  # one whole prompt, exactly the largest size
        [(7, 1), (3, 1), (9, 1), (2, 1)],  # decode rows only
        [(5, 1), (0, 6), (11, 2)],  # a decode row beside prompt chunks
        [(12, 5)],  # a later chunk of a long prompt
    ],
)
def test_mixed_steps_equal_eager(toy: tuple[ToyWorld, Any], chunks: list[tuple[int, int]]) -> None:
    world, runner = toy
    _replay_against_eager(world, runner, chunks)


def test_padded_rows_hold_their_rules_on_both_axes(toy: tuple[ToyWorld, Any]) -> None:
    """After a replay of 5 tokens of 2 requests (padded to 8 tokens, 4
    requests) every padded token and request row holds the table's value."""
    world, runner = toy
    runner.sanitizer, sanitizer = None, runner.sanitizer
    try:
        _replay_against_eager(world, runner, [(3, 2), (0, 3)])
    finally:
        runner.sanitizer = sanitizer
    t = runner.buffers.tensors
    for name in ("input_ids", "positions", "out_cache_loc", "token_req_pool_indices"):
        assert t[name][5:8].tolist() == [0, 0, 0], name
    assert t["req_pool_indices"][2:4].tolist() == [0, 0]
    assert t["seq_lens"][2:4].tolist() == [1, 1]
    assert t["seq_lens_cpu"][2:4].tolist() == [1, 1]
    assert t["extend_lens"][2:4].tolist() == [0, 0]
    assert t["extend_lens_cpu"][2:4].tolist() == [0, 0]
    assert t["last_token_index"][2:4].tolist() == [0, 0]
    assert t["extend_lens"][:2].tolist() == [2, 3]
    assert t["last_token_index"][:2].tolist() == [1, 4]


def test_more_requests_than_the_request_axis_run_eagerly(toy: tuple[ToyWorld, Any]) -> None:
    world, runner = toy
    before = runner.stats.eager_fallbacks
    _replay_against_eager(world, runner, [(2, 1)] * (MAX_REQUESTS + 1))
    assert runner.stats.eager_fallbacks == before + 1


def test_buffers_lie_on_their_axes() -> None:
    specs = {s.name: s for s in token_batch_specs()}
    token = {n for n, s in specs.items() if s.axis is Axis.TOKEN}
    assert token == {"input_ids", "positions", "out_cache_loc", "token_req_pool_indices"}
    world = ToyWorld()
    runner = create_runner(
        token_batch_phase(world.model.forward_token_batch, max_requests=3),
        kind="eager", capture_sizes=[2, 8], show_progress=False,
    )  # fmt: skip
    assert runner.buffers.max_size == StepSize(8, 3)
    assert runner.buffers.tensors["input_ids"].shape == (8,)
    assert runner.buffers.tensors["seq_lens"].shape == (3,)
    assert runner.buffers.view(2).bs == 2  # 2 tokens hold at most 2 requests
    assert runner.buffers.view(8).input_ids.shape == (8,)
    assert runner.buffers.view(8).seq_lens.shape == (3,)


def test_default_token_sizes() -> None:
    assert default_token_sizes(2048) == [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    assert default_token_sizes(100) == [4, 8, 16, 32, 64, 100]
    assert default_token_sizes(3) == [3]
    with pytest.raises(ValueError, match="max_tokens"):
        default_token_sizes(0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("extend_lens", [2, 0], r"extend_lens\[1\]=0"),
        ("seq_lens", [1, 5], r"seq_lens\[0\]=1 < extend_lens\[0\]=2"),
        ("req_pool_indices", [0, 2], r"req_pool_indices\[0\]=0"),
        ("input_ids", [1, 2, 3], "input_ids has 3 values; expected 5"),
        ("seq_lens", [5], "seq_lens has 1 values; expected one per request"),
    ],
)
def test_token_batch_inputs_name_what_is_wrong(field: str, value: list[int], message: str) -> None:
    args: dict[str, Any] = {
        "input_ids": [1, 2, 3, 4, 5],
        "out_cache_loc": [11, 12, 13, 14, 15],
        "req_pool_indices": [1, 2],
        "seq_lens": [4, 3],
        "extend_lens": [2, 3],
    }
    args[field] = value
    with pytest.raises(ValueError, match=message):
        token_batch_inputs(**args)


def test_token_batch_inputs_derive_the_layout() -> None:
    b = token_batch_inputs(
        input_ids=[5, 6, 7, 8], out_cache_loc=[20, 21, 22, 23],
        req_pool_indices=[3, 1], seq_lens=[10, 3], extend_lens=[1, 3],
    )  # fmt: skip
    assert b.batch_size == 2
    assert b.positions.tolist() == [9, 0, 1, 2]
    assert b.token_req_pool_indices.tolist() == [3, 1, 1, 1]
    assert b.last_token_index.tolist() == [0, 3]
    assert b.extend_lens_cpu.tolist() == [1, 3]


def test_the_phase_needs_its_request_axis() -> None:
    from graphrunner.core.phase import Phase

    with pytest.raises(ValueError, match="max_requests"):
        Phase("t", lambda b: b, tuple(token_batch_specs()))


# --- planted bugs the sanitizer must refuse ---------------------------------


def _planted_runner(world: ToyWorld, forward: Any, kind: str) -> Any:
    runner = create_runner(
        token_batch_phase(forward, max_requests=MAX_REQUESTS), kind=kind,
        capture_sizes=[8], sanitizer=_sanitizer(world), show_progress=False,
    )  # fmt: skip
    runner.capture()
    return runner


def _padded_token_writes_a_live_slot(world: ToyWorld) -> Any:
    model = world.model

    def forward(b: Any) -> torch.Tensor:
        out = model.forward_token_batch(b)
        # The bug: padded tokens (slot 0) write the first live request's first
        # cached slot, which its request owns and this step does not write.
        first = world.req_pool.req_to_token[b.req_pool_indices[:1], 0].long()
        loc = torch.where(b.out_cache_loc == 0, first, b.out_cache_loc)
        k = model.kv_of(b.input_ids, b.positions)
        world.kv.set_kv(0, loc, k, -k)
        return out

    return forward


def _live_reads_a_padded_token(world: ToyWorld) -> Any:
    model = world.model

    def forward(b: Any) -> torch.Tensor:
        # The bug: a statistic over every token of the step, padded ones included.
        k = model.kv_of(b.input_ids, b.positions)
        return model.forward_token_batch(b) + k.mean() * 0.1

    return forward


def _attends_past_its_position(world: ToyWorld) -> Any:
    model = world.model

    def forward(b: Any) -> torch.Tensor:
        # The bug: each token reads one column past its own position (the
        # last token of a request reaches req_to_token's 0, the sink).
        rows = BufferView(
            b.bs,
            {
                "input_ids": b.input_ids,
                "positions": b.positions,
                "out_cache_loc": b.out_cache_loc,
                "req_pool_indices": b.token_req_pool_indices,
                "seq_lens": b.positions + 2,
            },
        )
        return model.forward(rows)[b.last_token_index]

    return forward


@pytest.mark.parametrize(
    ("plant", "finding", "kind"),
    [
        (_padded_token_writes_a_live_slot, "changed during replay", "eager"),
        (_live_reads_a_padded_token, "changed when only", "eager"),
        (_attends_past_its_position, "changed when only", "eager"),
        # One compiled program too (each plant compiles one: the rest stay eager).
        (_attends_past_its_position, "changed when only", "cpu"),
    ],
)
def test_planted_bugs_are_refused(plant: Any, finding: str, kind: str) -> None:
    world = ToyWorld()
    runner = _planted_runner(world, plant(world), kind)
    batch = world.make_token_batch([(6, 2), (0, 3)], seed=5)  # 5 tokens padded to 8
    with pytest.raises(PaddingViolation, match=finding):
        runner.replay(batch)


def test_a_wrong_position_is_refused_by_the_value_checks() -> None:
    world = ToyWorld()
    runner = _planted_runner(world, world.model.forward_token_batch, "eager")
    batch = world.make_token_batch([(6, 2), (0, 3)], seed=5)
    batch.positions[1] += 1  # not seq_lens - extend_lens + j
    with pytest.raises(PaddingViolation, match=r"positions batch row 1"):
        runner.replay(batch)


def test_token_counts_must_cover_the_tokens() -> None:
    world = ToyWorld()
    runner = _planted_runner(world, world.model.forward_token_batch, "eager")
    batch = world.make_token_batch([(6, 2), (0, 3)], seed=5)
    batch.extend_lens[0] = 1  # the device counts disagree with the tokens
    with pytest.raises(PaddingViolation, match="summing to the 5 live tokens"):
        runner.replay(batch)


# --- CUDA: one full graph per token size ------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("compile_", [False, True], ids=["graphs", "graphs+compile"])
def test_cuda_full_graphs_per_token_size(compile_: bool) -> None:
    """The toy's token forward reads its layout from device tensors only
    (each token a decode row), so each token size is one CUDA graph: every
    token count up to the largest and one above equals eager, sanitized."""
    world = ToyWorld("cuda")
    phase = token_batch_phase(world.model.forward_token_batch, max_requests=MAX_REQUESTS)
    runner = create_runner(
        phase, kind="cuda", compile=compile_, capture_sizes=SIZES,
        sanitizer=_sanitizer(world), show_progress=False,
    )  # fmt: skip
    runner.capture()
    for tokens in range(1, SIZES[-1] + 2):
        _replay_against_eager(world, runner, _chunks(tokens, seed=tokens))
    assert runner.stats.replays == SIZES[-1] and runner.stats.eager_fallbacks == 1


@pytest.mark.cuda
def test_cuda_llama_token_batch_equals_its_eager_prefill() -> None:
    """The reference Llama on CUDA runs a token batch as one decode row per
    token (the Triton kernel reads the layout on the device), captured per
    token size: each chunk's last logits equal its eager ``forward_extend``."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from spec_world import SpecWorld

    w = SpecWorld("cuda")
    b, model = w.bundle, w.model
    runner = create_runner(
        token_batch_phase(model.forward_token_batch, max_requests=MAX_REQUESTS),
        kind="cuda", capture_sizes=[8, 16],
        sanitizer=PaddingSanitizer.for_pools(b.req_pool, b.kv_cache, kv_allocator=b.kv_alloc),
        show_progress=False,
    )  # fmt: skip
    runner.capture()
    for splits in ([5], [1, 7, 3], [12, 1, 1, 2]):
        requests = w.reset(len(splits), seed=3)
        batch = w.token_batch(requests, sum(splits), seed=len(splits))
        before = w.state()
        start, want = 0, []
        for (row, committed), n in zip(requests, batch.extend_lens_cpu.tolist(), strict=True):
            ids, locs = batch.input_ids[start : start + n], batch.out_cache_loc[start : start + n]
            want.append(model.forward_extend(row, ids, locs, prefix_len=committed))
            start += n
        w.restore(before)
        got = runner.replay(batch)
        torch.testing.assert_close(got, torch.stack(want), rtol=1e-4, atol=1e-4)
