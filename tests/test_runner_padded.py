"""Every runner at every batch size 1..max: live outputs equal the eager
forward of the unpadded batch, and no state outside the live rows and slot 0
changes, with every static buffer's tail poisoned before replay."""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import PADDED_CASES, TEST_CAPTURE_SIZES, CapturedToy
from graphrunner.sanitizer.padding import check_tails
from poison import assert_state_matches, poison_tails, stale_values, state_is_bit_exact


def changed_kv_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set(torch.nonzero((before != after).flatten(1).any(1)).flatten().tolist())


@pytest.mark.padded
@pytest.mark.parametrize("raw_bs", range(1, TEST_CAPTURE_SIZES[-1] + 1))
def test_padded_replay_matches_eager_and_spares_state(captured_toy: CapturedToy, raw_bs: int):
    world, runner = captured_toy.world, captured_toy.runner
    batch = world.make_batch(raw_bs, seed=raw_bs)
    before = world.state()
    expected, expected_state = world.eager_reference(batch)  # eager, unpadded

    poison_tails(runner, raw_bs, stale_values(world, batch))
    out = runner.replay(batch).clone()
    after = world.state()
    PADDED_CASES.add((runner.mechanism.label, runner.graph_size_for(raw_bs), raw_bs))

    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected)
    live_slots = set(batch.out_cache_loc.tolist())
    for name in ("k", "v"):
        changed = changed_kv_slots(before[name], after[name])
        assert changed <= live_slots | {0}, f"{name}: slots {changed - live_slots - {0}} written"
        # Live rows hold what the eager step wrote (slot 0 is a sink).
        exact = state_is_bit_exact(runner.mechanism.label)
        assert_state_matches(after[name], expected_state[name], live_slots, exact=exact, name=name)
    assert torch.equal(after["req_to_token"], before["req_to_token"])
    assert not after["req_to_token"][0].any()
    # The poison is gone: every tail holds its pad value, not a live index
    # (a padded row reading live state changes nothing this toy returns).
    check_tails(runner.buffers, raw_bs, runner.graph_size_for(raw_bs))


def test_replay_counts_padding(captured_toy: CapturedToy):
    world, runner = captured_toy.world, captured_toy.runner
    stats_before = (runner.stats.replays, runner.stats.padded_rows)
    runner.replay(world.make_batch(3, seed=0))
    assert runner.stats.replays == stats_before[0] + 1
    assert runner.stats.padded_rows == stats_before[1] + 1  # 3 -> 4
    # Live rows and tails at once: one foreach copy on a device; on the CPU one
    # cat of the packed decode fields into staging and one copy out of it.
    assert runner.stats.last_populate_ops == (1 if runner.device.type == "cuda" else 2)


def test_oversized_batch_runs_eagerly_and_warns_once(captured_toy: CapturedToy):
    world, runner = captured_toy.world, captured_toy.runner
    runner._warned_fallback = False
    fallbacks, live, padded = (
        runner.stats.eager_fallbacks,
        runner.stats.live_rows,
        runner.stats.padded_rows,
    )
    big = TEST_CAPTURE_SIZES[-1] + 3
    batch = world.make_batch(big, seed=1)
    expected, _ = world.eager_reference(batch)
    with pytest.warns(RuntimeWarning, match=f"batch size {big}"):
        out = runner.replay(batch)
    torch.testing.assert_close(out, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # second time: no warning, still counted
        runner.replay(world.make_batch(big, seed=2))
    assert runner.stats.eager_fallbacks == fallbacks + 2
    assert (runner.stats.live_rows, runner.stats.padded_rows) == (live + 2 * big, padded)


def test_capture_is_largest_first_and_reported(captured_toy: CapturedToy):
    report = captured_toy.runner.capture_report
    assert report is not None
    assert [s.bs for s in report.sizes] == sorted(TEST_CAPTURE_SIZES, reverse=True)
    assert report.total_seconds > 0
    assert "total" in report.format()
