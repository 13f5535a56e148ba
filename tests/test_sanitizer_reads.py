"""Read isolation under the sanitizer: planted read bugs, each invisible to
the write checks, are caught on every runner; the correct model passes.

- off by one: each live row attends one column past its length (that column
  is KV slot 0, the padded rows' sink);
- rows that mix: a batch mean over every row, padded ones included;
- a padded row's value input reaching the live rows (a float buffer of the
  step, averaged over the batch);
- a stale index: live row 0 reads another request's KV (a bystander's row of
  ``req_to_token``, every slot of it owned by no live row, none the sink);
- the previous step's output: the step adds what it returned last time (kept
  in a buffer of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from conftest import RUNNER_PARAMS, make_runner
from graphrunner import BufferSpec, PaddingSanitizer, PaddingViolation, PadRule, decode_buffer_specs
from graphrunner.declare import DECODE_FIELD_NAMES
from graphrunner.phases import SpecBatch
from graphrunner.testing import ToyWorld

HIDDEN = "bias"  # a float buffer of the step: [bs, 1], 0 on padded rows


class _OnePast:
    """The step's inputs with every length one longer: the toy model then
    attends one column past each row's cache (that column is KV slot 0)."""

    def __init__(self, b: Any) -> None:
        self.b = b
        self.seq_lens = b.seq_lens + 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.b, name)


def _correct(world: ToyWorld) -> Callable[[Any], torch.Tensor]:
    return lambda b: world.model.forward(b) + b.bias


def _off_by_one(world: ToyWorld) -> Callable[[Any], torch.Tensor]:
    return lambda b: world.model.forward(_OnePast(b)) + b.bias


def _rows_mix(world: ToyWorld) -> Callable[[Any], torch.Tensor]:
    def forward(b: Any) -> torch.Tensor:
        logits = world.model.forward(b) + b.bias
        return logits + logits.mean(0, keepdim=True)  # a statistic over the padded rows too

    return forward


def _padded_input_reaches(world: ToyWorld) -> Callable[[Any], torch.Tensor]:
    return lambda b: world.model.forward(b) + b.bias.mean()  # the padded rows' bias is in the mean


#: The bystander request row the stale index reads (ToyWorld.make_batch adds
#: its bystanders first: rows 1..4), and a seed whose bystander there holds
#: at least as many tokens as live row 0 (so no column it reads is the sink).
STALE_ROW, STALE_SEED = 1, 0


class _StaleRow:
    def __init__(self, b: Any) -> None:
        self.b = b
        first = torch.arange(b.req_pool_indices.shape[0], device=b.req_pool_indices.device) == 0
        self.req_pool_indices = torch.where(first, STALE_ROW, b.req_pool_indices)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.b, name)


def _stale_index(world: ToyWorld) -> Callable[[Any], torch.Tensor]:
    return lambda b: world.model.forward(_StaleRow(b)) + b.bias


def _previous_output(world: ToyWorld) -> Callable[[Any], torch.Tensor]:
    last = torch.zeros(8, world.cfg.vocab, device=world.device)

    def forward(b: Any) -> torch.Tensor:
        logits = world.model.forward(b) + b.bias
        out = logits + last[: logits.shape[0]]
        last[: logits.shape[0]].copy_(logits)
        return out

    return forward


def _stale_seed(world: ToyWorld) -> int:
    """The first seed whose bystander STALE_ROW is no shorter than live row 0."""
    for seed in range(100):
        batch = world.make_batch(3, seed=seed)
        row0, len0 = int(batch.req_pool_indices_cpu[0]), int(batch.seq_lens_cpu[0])
        owned = int((world.req_pool.req_to_token[STALE_ROW] != 0).sum())
        if row0 != STALE_ROW and owned >= len0:
            return seed
    raise AssertionError("no seed gives a long enough bystander")


def _runner(kind: str, world: ToyWorld, forward: Callable[[Any], torch.Tensor]) -> Any:
    specs = [
        *decode_buffer_specs(),
        BufferSpec(HIDDEN, torch.float32, PadRule.ZERO, extra_shape=(1,)),
    ]
    runner = make_runner(kind, forward, specs, capture_sizes=[4])
    runner.capture()
    runner.sanitizer = PaddingSanitizer.for_pools(
        world.req_pool, world.kv, kv_allocator=world.kv_alloc, vocab_size=world.cfg.vocab
    )
    return runner


def _replay(world: ToyWorld, runner: Any, raw_bs: int, seed: int) -> torch.Tensor:
    batch = world.make_batch(raw_bs, seed=seed)
    inputs = SpecBatch(
        req_pool_indices_cpu=batch.req_pool_indices_cpu,
        seq_lens_cpu=batch.seq_lens_cpu,
        bias=torch.rand(raw_bs, 1, generator=torch.Generator().manual_seed(seed)).to(world.device),
        **{name: getattr(batch, name) for name in DECODE_FIELD_NAMES},
    )
    out: torch.Tensor = runner.replay(inputs)
    return out


@pytest.mark.parametrize("kind", RUNNER_PARAMS)
def test_the_correct_model_passes_at_every_padded_size(kind: str) -> None:
    world = ToyWorld("cuda" if kind.startswith("cuda") else "cpu")
    runner = _runner(kind, world, _correct(world))
    for raw_bs in (1, 2, 3, 4):
        world.reset()
        _replay(world, runner, raw_bs, seed=raw_bs)
    assert runner.sanitizer.stats.replays_checked == 4


@pytest.mark.parametrize("kind", RUNNER_PARAMS)
@pytest.mark.parametrize(
    ("bug", "depends_on"),
    [
        (_off_by_one, "the sinks of k_cache[0], v_cache[0]"),
        (_rows_mix, "padded rows' input_ids, bias"),
        (_padded_input_reaches, "padded rows' input_ids, bias"),
        (_stale_index, "k_cache[0]'s KV slots no live row owns"),
        (_previous_output, "padded rows' input_ids, bias"),
    ],
    ids=["off-by-one", "rows-mix", "padded-input", "stale-index", "previous-output"],
)
def test_a_planted_read_bug_is_caught(
    kind: str, bug: Callable[[ToyWorld], Callable[[Any], torch.Tensor]], depends_on: str
) -> None:
    world = ToyWorld("cuda" if kind.startswith("cuda") else "cpu")
    seed = _stale_seed(world) if bug is _stale_index else 0
    runner = _runner(kind, world, bug(world))
    with pytest.raises(
        PaddingViolation, match=r"output 'output', batch row \d+: changed when"
    ) as e:
        _replay(world, runner, 3, seed=seed)
    assert depends_on in str(e.value)
    world.reset()
    runner.sanitizer.check_reads = False  # the write checks alone do not see it
    _replay(world, runner, 3, seed=seed)


def test_the_message_names_what_the_row_depended_on() -> None:
    world = ToyWorld()
    runner = _runner("eager", world, _off_by_one(world))
    with pytest.raises(PaddingViolation) as caught:
        _replay(world, runner, 3, seed=0)
    assert "the sinks of k_cache[0], v_cache[0]" in str(caught.value)


def test_the_state_after_a_checked_replay_is_the_first_launchs() -> None:
    """The relaunch's changes to the sinks and tails never outlive the check."""
    world = ToyWorld()
    plain = _runner("eager", world, _correct(world))
    plain.sanitizer = None
    first = _replay(world, plain, 3, seed=5).clone()
    state = world.state()
    world.reset()
    checked = _runner("eager", world, _correct(world))
    assert torch.equal(_replay(world, checked, 3, seed=5), first)
    assert all(torch.equal(world.state()[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", RUNNER_PARAMS)
def test_rows_mixed_through_the_embedding_are_caught_with_no_vocabulary(kind: str) -> None:
    """A model of one's own, no vocabulary declared to the sanitizer: its live
    rows add the mean of every row's embedded token, padded rows included.
    The read check changes the padded rows' token ids to the live rows' own
    (always valid ids) and sees the live outputs move."""
    world = ToyWorld("cuda" if kind.startswith("cuda") else "cpu")
    embedding = torch.randn(
        world.cfg.vocab, world.cfg.vocab, generator=torch.Generator().manual_seed(5)
    )
    embedding = embedding.to(world.device)

    def forward(b: Any) -> torch.Tensor:
        embedded = embedding[b.input_ids]
        return world.model.forward(b) + b.bias + embedded.mean(0, keepdim=True)

    specs = [
        *decode_buffer_specs(),
        BufferSpec(HIDDEN, torch.float32, PadRule.ZERO, extra_shape=(1,)),
    ]
    runner = make_runner(kind, forward, specs, capture_sizes=[4])
    runner.capture()
    runner.sanitizer = PaddingSanitizer.for_pools(
        world.req_pool, world.kv, kv_allocator=world.kv_alloc
    )
    with pytest.raises(PaddingViolation, match="padded rows' input_ids"):
        _replay(world, runner, 3, seed=1)
    world.reset()
    _replay(world, runner, 4, seed=1)  # no padded row: nothing to mix in
