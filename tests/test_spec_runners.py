"""The speculative phases (target verify, the verify that samples, EAGLE
draft extend, frozen-KV MTP) at every batch size on every mechanism: poisoned tails (live indices, NaN
hidden states), the sanitizer on, live outputs equal to the eager unpadded
forward, state outside the live rows untouched."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from sampled_rows import sampled_verify_inputs

from conftest import RUNNER_PARAMS, make_runner, runner_device
from graphrunner import GraphRunner, create_runner
from graphrunner.phases import (
    EagleDraftExtendRunner,
    FrozenKvMtpRunner,
    frozen_kv_sanitizer,
    verify_phase,
)
from graphrunner.phases.verify import rejection_forward
from graphrunner.sanitizer.padding import PaddingSanitizer
from spec_world import SpecWorld

SIZES = [2, 4]
W = 4  # > steps + 1 of the MTP loop (3): a stride bug between the two shows
PHASES = ["verify", "sampled_verify", "eagle", "mtp"]


class Phase:
    """One phase's runner over a world, and how to make its inputs and eager reference."""

    def __init__(self, phase: str, label: str) -> None:
        self.phase, self.world = phase, SpecWorld(runner_device(label))
        kind, options = __import__("conftest").MECHANISMS[label]
        common: dict[str, Any] = {
            "device": self.world.device,
            "capture_sizes": SIZES,
            "show_progress": False,
            "kind": kind,
            **options,
            "sanitizer": self._sanitizer(),
        }
        w = self.world
        if phase == "verify":
            self.runner: GraphRunner = create_runner(verify_phase(w.model, W), **common)
            self.forward: Callable[[Any], Any] = w.model.forward_tokens
        elif phase == "sampled_verify":
            self.runner = create_runner(verify_phase(w.model, W, sampling=True), **common)
            self.forward = rejection_forward(w.model.forward_tokens, W)
        elif phase == "eagle":
            self.runner = EagleDraftExtendRunner(w.eagle, W, **common)
            self.forward = w.eagle.forward_extend
        else:
            self.runner = FrozenKvMtpRunner(w.mtp, **common)
            self.forward = w.mtp.forward_draft
        self.runner.capture()

    def _sanitizer(self) -> PaddingSanitizer:
        b = self.world.bundle
        if self.phase == "mtp":
            return frozen_kv_sanitizer(b.req_pool, b.kv_cache)
        kv = self.world.draft_kv if self.phase == "eagle" else b.kv_cache
        return PaddingSanitizer.for_pools(b.req_pool, kv, kv_allocator=b.kv_alloc)

    def inputs(self, raw_bs: int, seed: int) -> Any:
        w = self.world
        requests = w.reset(raw_bs, seed)
        if self.phase == "verify":
            return w.verify_inputs(requests, W, seed)
        if self.phase == "sampled_verify":
            return sampled_verify_inputs(w.verify_inputs(requests, W, seed), W, 256, seed)
        if self.phase == "eagle":
            return w.eagle_inputs(requests, W, seed)
        return w.mtp_inputs(requests, seed)


def _label(param: Any) -> str:
    return param.values[0] if hasattr(param, "values") else param


def _marks(phase: str, param: Any) -> list[Any]:
    """The runner's marks."""
    return list(getattr(param, "marks", ()))


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((p, _label(m)), marks=_marks(p, m), id=f"{p}-{_label(m)}")
        for p in PHASES
        for m in RUNNER_PARAMS
    ],
)
def phase(request: pytest.FixtureRequest) -> Iterator[Phase]:
    name, label = request.param
    yield Phase(name, label)


def _poison(runner: GraphRunner, raw_bs: int, live_slot: int, live_row: int) -> None:
    """Stale tails: indices of live state, huge lengths, NaN hidden states."""
    for spec in runner.buffers.specs:
        tail = runner.buffers.tensors[spec.name][spec.rows(raw_bs) :]
        if tail.is_floating_point():
            tail.fill_(float("nan"))
        elif spec.name == "req_pool_indices":
            tail.fill_(live_row)
        elif spec.name == "out_cache_loc":
            tail.fill_(live_slot)
        else:
            tail.fill_(60)


@pytest.mark.parametrize("raw_bs", range(1, SIZES[-1] + 1))
def test_padded_replay_equals_the_eager_unpadded_forward(phase: Phase, raw_bs: int):
    world, runner = phase.world, phase.runner
    inputs = phase.inputs(raw_bs, seed=raw_bs)
    before = world.state()
    with torch.no_grad():
        expected = {k: v.clone() for k, v in phase.forward(inputs).items()}
    expected_state = world.state()
    world.restore(before)
    row = int(inputs.req_pool_indices_cpu[0])
    _poison(runner, raw_bs, int(world.bundle.req_pool.req_to_token[row, 0]), row)
    out = runner.replay(inputs)
    assert set(out) == set(expected)
    for name, value in expected.items():
        assert out[name].shape == value.shape, name
        assert not (out[name].is_floating_point() and out[name].isnan().any()), name
        if value.is_floating_point():
            torch.testing.assert_close(out[name], value, msg=name)
        else:
            assert torch.equal(out[name], value), name
    after = world.state()
    for name, value in expected_state.items():  # slot 0 is the padding sink
        # Compiled programs round differently from eager: KV close, indices exact.
        torch.testing.assert_close(after[name][1:], value[1:], msg=name, rtol=1e-5, atol=1e-5)
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked > 0


@pytest.mark.parametrize("raw_bs", [1, 3])
def test_every_index_in_range_and_padded_rows_stay_in_their_own_row(phase: Phase, raw_bs: int):
    runner = phase.runner
    runner.replay(phase.inputs(raw_bs, seed=10 + raw_bs))
    bs = runner.graph_size_for(raw_bs)
    view = runner.buffers.view(bs)
    slots = phase.world.bundle.kv_alloc.size + 1
    for spec in runner.buffers.specs:
        if not spec.index:
            continue
        values = getattr(view, spec.name)
        assert int(values.min()) >= 0 and int(values.max()) < max(slots, 256), spec.name
    if phase.phase == "eagle":
        select = torch.arange(bs) * W + view.accept_lens.cpu() - 1
        rows = select // W
        assert torch.equal(rows, torch.arange(bs))
    if phase.phase in ("verify", "sampled_verify", "eagle"):
        prefix = view.seq_lens - W
        assert int(prefix.min()) >= 0


def test_replaying_twice_leaves_the_inputs_unchanged(phase: Phase):
    runner = phase.runner
    first = {k: v.clone() for k, v in runner.replay(phase.inputs(3, seed=20)).items()}
    buffers = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    again = runner.relaunch(4)
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t, buffers[name]), f"{name} mutated by the graph"
    for name, value in first.items():
        torch.testing.assert_close(again[name][: value.shape[0]], value, msg=name)


def test_the_frozen_kv_runner_reads_exactly_the_committed_length():
    """NaN planted in K and V at position seq_len of every live request (a
    cached token past the committed length) never reaches an output, and the
    whole target KV cache stays bit-identical."""
    p = Phase("mtp", "eager")
    world = p.world
    inputs = p.inputs(3, seed=30)
    with torch.no_grad():
        expected = {k: v.clone() for k, v in world.mtp.forward_draft(inputs).items()}
    b = world.bundle
    for row, committed in zip(
        inputs.req_pool_indices_cpu.tolist(), inputs.seq_lens_cpu.tolist(), strict=True
    ):
        slot = int(b.req_pool.req_to_token[row, committed])
        for t in (*b.kv_cache.k_buffers, *b.kv_cache.v_buffers):
            t[slot] = float("nan")
    before = world.state()
    out = p.runner.replay(inputs)
    for name, value in expected.items():
        torch.testing.assert_close(out[name], value, msg=name)
    after = world.state()
    for name, value in before.items():
        assert torch.equal(after[name].nan_to_num(7.0), value.nan_to_num(7.0)), name


def test_mtp_top_k_candidates_form_a_tree_at_bs_above_1():
    p = Phase("mtp", "eager")
    out = p.runner.replay(p.inputs(3, seed=40))
    steps, k = p.world.mtp.steps, p.world.mtp.topk
    assert k > 1 and steps + 1 < W  # the shape that hides stride bugs at bs 1 or W = steps + 1
    assert out["tokens"].shape == (3, steps, k) and out["parents"].shape == (3, steps, k)
    assert (out["parents"][:, 0] == -1).all()
    assert int(out["parents"][:, 1:].min()) >= 0 and int(out["parents"][:, 1:].max()) < k
    scores = out["scores"]
    assert (scores[:, 1:].max(-1).values <= scores[:, :-1].max(-1).values + 1e-6).all()


def test_a_batch_of_another_width_runs_eagerly_counted_and_warned_once():
    p = Phase("verify", "eager")
    world = p.world
    requests = world.reset(2, seed=50)
    narrow = world.verify_inputs(requests, W - 1, seed=50)
    before = world.state()
    with torch.no_grad():
        expected = world.model.forward_tokens(narrow)["logits"].clone()
    world.restore(before)
    with pytest.warns(
        RuntimeWarning, match=f"batch width {W - 1} differs from the captured width {W}"
    ):
        out = p.runner.replay(narrow)
    torch.testing.assert_close(out["logits"], expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.runner.replay(narrow)
    assert p.runner.stats.eager_fallbacks == 2 and p.runner.stats.replays == 0


def test_draft_runners_hold_no_padding_code():
    """Like the decode runners: the phase classes declare, populate pads."""
    import inspect

    import graphrunner.phases as spec

    for module in (spec.base, spec.verify, spec.eagle, spec.mtp):
        source = inspect.getsource(module)
        for forbidden in ("fill_(", "zero_(", "[raw_bs:", "masked_fill"):
            assert forbidden not in source, (module.__name__, forbidden)
    assert make_runner  # the shared factory stays importable for phase tests
