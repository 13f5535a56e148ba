"""A SpecBatch as a sealed step value: checked once where it is built (or by
``seal``), then replayed without the per-field checks by a runner whose
buffers its seal covers, with the same outputs and buffers as an unsealed
replay; anything assigned from outside breaks the seal and is then refused
by name, an in-place change of a host mirror drops its known range (the
backend's range check sees it), and a step that does not fit is refused at
seal time."""

from __future__ import annotations

import pytest
import torch

import graphrunner.core.input_check as input_check
from graphrunner import GraphRunner, create_runner, decode_buffer_specs
from graphrunner.core import host_range
from graphrunner.declare import NullBackend
from graphrunner.declare.buffers import StepSize
from graphrunner.phases import SpecBatch, token_batch_phase, token_batch_specs, with_sampling
from graphrunner.sampling import SAMPLING_FIELD_NAMES
from graphrunner.testing import ToyWorld
from graphrunner.writers import PopulateError

CHUNKS = [(0, 5), (9, 1), (4, 1)]  # 7 tokens of 3 requests: a prompt chunk and two decode rows
MIRRORS = ("req_pool_indices_cpu", "seq_lens_cpu")
SEQ_LIMIT = 64  # what _RangeBackend accepts in seq_lens_cpu


class _RangeBackend(NullBackend):
    """Refuses a step whose ``seq_lens_cpu`` exceeds SEQ_LIMIT, from
    :func:`graphrunner.core.host_range` (as the model's attention backend does)."""

    def validate_inputs(self, raw_bs: object, inputs: object) -> None:
        mirror = inputs.seq_lens_cpu  # type: ignore[attr-defined]
        bounds = host_range(inputs, "seq_lens_cpu", mirror)
        if bounds is not None and bounds[1] > SEQ_LIMIT:
            raise ValueError(f"seq_lens_cpu max {bounds[1]}: expected <= {SEQ_LIMIT}")


def _token_runner(
    world: ToyWorld, *, host_layout: bool = True, backend: NullBackend | None = None
) -> GraphRunner:
    forward = world.model.forward_token_batch
    phase = token_batch_phase(forward, max_requests=4, host_layout=host_layout, backend=backend)
    runner = create_runner(phase, kind="eager", capture_sizes=[8], show_progress=False)
    runner.capture()
    return runner


def _plain(batch: SpecBatch) -> SpecBatch:
    """The same tensors in a new SpecBatch that nobody sealed."""
    tensors = batch.tensors()
    return SpecBatch(**{n: tensors.pop(n) for n in MIRRORS}, **tensors)


def _count_full_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the gate's per-field check (check_sources)."""
    calls = [0]
    real = input_check.check_sources

    def counting(*args: object) -> object:
        calls[0] += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(input_check, "check_sources", counting)
    return calls


def _replay_poisoned(runner: GraphRunner, batch: object) -> tuple[torch.Tensor, dict]:
    """The replay's outputs and every buffer it left, from poisoned buffers."""
    for t in runner.buffers.tensors.values():
        t.fill_(-7)
    out = runner.replay(batch).clone()
    return out, {n: t.clone() for n, t in runner.buffers.tensors.items()}


def _snapshot(runner: GraphRunner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in runner.buffers.tensors.items()}


def _unchanged(runner: GraphRunner, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(t, before[n]) for n, t in runner.buffers.tensors.items())


def test_a_built_token_batch_replays_sealed_with_the_unsealed_outputs_exactly(monkeypatch):
    world = ToyWorld()
    runner = _token_runner(world)
    batch = world.make_token_batch(CHUNKS, seed=0)
    assert batch.sealed and batch.is_sealed()
    calls = _count_full_checks(monkeypatch)
    state = world.state()
    sealed_out, sealed_buffers = _replay_poisoned(runner, batch)
    assert calls[0] == 0 and runner.input_gate.full_checks == 0  # the fast path
    world.restore(state)
    plain_out, plain_buffers = _replay_poisoned(runner, _plain(batch))
    assert calls[0] == 1  # never sealed: checked in full
    assert torch.equal(sealed_out, plain_out)
    for name, t in plain_buffers.items():  # padding written alike (padded rows: slot 0)
        assert torch.equal(sealed_buffers[name], t), name
    assert int(runner.buffers.tensors["out_cache_loc"][7]) == 0  # the padded token


def test_a_spec_batch_sealed_for_the_decode_phase_takes_the_fast_path(monkeypatch):
    world = ToyWorld()
    runner = create_runner(
        world.model, decode_buffer_specs(), kind="eager", capture_sizes=[4], show_progress=False
    )
    runner.capture()
    decode = world.make_batch(3, seed=1)
    names = [s.name for s in decode_buffer_specs()]
    step = SpecBatch(**{n: getattr(decode, n) for n in (*names, *MIRRORS)})
    assert step.seal(runner.phase.specs, "cpu") is step and step.sealed
    assert step.host_range("seq_lens_cpu") == step.host_ranges["seq_lens_cpu"][2:]
    calls = _count_full_checks(monkeypatch)
    state = world.state()
    out, _ = _replay_poisoned(runner, step)
    world.restore(state)
    expected, _ = _replay_poisoned(runner, decode)
    assert calls[0] == 0
    assert torch.equal(out, expected)


def test_a_seal_that_does_not_cover_the_buffers_is_checked_in_full(monkeypatch):
    world = ToyWorld()
    batch = world.make_token_batch(CHUNKS, seed=0)
    narrow = _plain(batch).seal(token_batch_specs(host_layout=False), "cpu")
    calls = _count_full_checks(monkeypatch)
    _token_runner(world).replay(narrow)  # the runner's host buffers were not checked
    assert calls[0] == 1
    _token_runner(world, host_layout=False).replay(batch)  # a subset of the seal's
    assert calls[0] == 1


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("positions", lambda t: t.float(), r"'positions' has dtype torch.float32"),
        ("out_cache_loc", lambda t: t[:2], r"'out_cache_loc' has shape \(2,\)"),
        ("extend_lens", lambda t: t.tolist(), r"'extend_lens' must be a torch.Tensor"),
        ("seq_lens_cpu", lambda t: t[:1], r"host mirror 'seq_lens_cpu'"),
        ("req_pool_indices_cpu", lambda t: t * 0, r"req_pool_indices_cpu\[0\]=0"),
    ],
)
def test_assigning_a_field_unseals_and_a_bad_value_is_refused_by_name(field, value, message):
    world = ToyWorld()
    runner = _token_runner(world)
    batch = world.make_token_batch(CHUNKS, seed=0)
    runner.replay(batch)
    setattr(batch, field, value(getattr(batch, field)))
    assert not batch.sealed
    before = _snapshot(runner)
    with pytest.raises(PopulateError, match=message):
        runner.replay(batch)
    assert _unchanged(runner, before)


def test_any_assignment_breaks_the_seal_even_of_the_seal_itself():
    batch = ToyWorld().make_token_batch(CHUNKS, seed=0)
    batch.input_ids = batch.input_ids  # the same tensor: still not what the seal saw
    assert not batch.sealed
    batch = ToyWorld().make_token_batch(CHUNKS, seed=0)
    batch.sealed = True  # a seal is made by checking, never by assignment
    assert not batch.sealed
    batch = ToyWorld().make_token_batch(CHUNKS, seed=0)
    del batch.last_token_index
    assert not batch.sealed


def test_an_in_place_change_of_a_mirror_after_sealing_is_caught_by_the_range_check():
    world = ToyWorld()
    runner = _token_runner(world, backend=_RangeBackend())
    batch = world.make_token_batch(CHUNKS, seed=0)
    runner.replay(batch)  # fine as built
    batch.seq_lens_cpu[1] = SEQ_LIMIT + 1  # in place: the seal stays, the version moves
    assert batch.sealed
    assert batch.host_range("seq_lens_cpu") == (5, SEQ_LIMIT + 1)
    before = _snapshot(runner)
    with pytest.raises(ValueError, match=rf"seq_lens_cpu max {SEQ_LIMIT + 1}"):
        runner.replay(batch)
    assert _unchanged(runner, before)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("positions", lambda t: t.to(torch.int32), r"'positions' has dtype torch.int32"),
        ("out_cache_loc", lambda t: t[:-1], r"'out_cache_loc' has shape \(6,\)"),
        ("seq_lens", lambda t: t.reshape(3, 1), r"'seq_lens' has shape \(3, 1\)"),
        ("seq_lens_cpu", lambda t: t.to(torch.int32), r"host mirror 'seq_lens_cpu'"),
        ("req_pool_indices_cpu", lambda t: t * 0, r"req_pool_indices_cpu\[0\]=0"),
    ],
)
def test_a_step_that_does_not_fit_is_refused_at_seal_time(field, value, message):
    batch = _plain(ToyWorld().make_token_batch(CHUNKS, seed=0))
    setattr(batch, field, value(getattr(batch, field)))
    with pytest.raises(PopulateError, match=message):
        batch.seal(token_batch_specs(), "cpu")
    assert not batch.sealed


def test_a_sealed_spec_batch_with_sampling_rows_is_not_trusted_as_a_decode_batch():
    batch = ToyWorld().make_token_batch(CHUNKS, seed=0)
    rows = {n: torch.zeros(3) for n in SAMPLING_FIELD_NAMES}
    assert batch.sealed and not with_sampling(batch, rows).is_sealed()


def test_the_seal_knows_the_step_size_and_the_mirror_ranges():
    batch = ToyWorld().make_token_batch(CHUNKS, seed=0)
    assert batch.batch_size == 3 and batch.bs == 3
    for name in MIRRORS:
        mirror = getattr(batch, name)
        assert batch.host_ranges[name][2:] == (int(mirror.min()), int(mirror.max()))
    assert batch.seal_key is not None and batch.seal_key.device == torch.device("cpu")
    assert StepSize(7, 3) == StepSize(batch.input_ids.shape[0], batch.batch_size)
