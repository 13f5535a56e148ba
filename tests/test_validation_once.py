"""Validation once: a DecodeBatch is checked where it is made, a foreign
input object in full on every replay, everything on every replay under a
sanitizer; every bad input still raises a named error
before anything is written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from graphrunner import GraphRunner, create_runner, decode_buffer_specs, decode_phase
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.phases import with_sampling
from graphrunner.sampling import SamplingParams, sampling_tensors
from graphrunner.sanitizer.padding import PaddingSanitizer
from graphrunner.testing import ToyWorld
from graphrunner.writers import PopulateError

FIELDS = ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "positions")


def _runner(world: ToyWorld, sanitized: bool = False) -> GraphRunner:
    sanitizer = None
    if sanitized:
        sanitizer = PaddingSanitizer.for_pools(
            world.req_pool, world.kv, kv_allocator=world.kv_alloc
        )
    runner = create_runner(
        world.model,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[4],
        sanitizer=sanitizer,
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    return runner


def _foreign(batch: DecodeBatch) -> SimpleNamespace:
    """The same step as a plain object: what an engine with its own batch passes."""
    names = (*FIELDS, "req_pool_indices_cpu", "seq_lens_cpu")
    return SimpleNamespace(batch_size=batch.batch_size, **{n: getattr(batch, n) for n in names})


def _assert_unchanged(runner: GraphRunner, before: dict[str, torch.Tensor]) -> None:
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t, before[name]), f"{name} written"


def test_a_batch_is_sealed_by_its_own_operations_and_unsealed_from_outside():
    world = ToyWorld()
    batch = world.make_batch(3, seed=0)
    assert batch.is_sealed()
    batch.filter([2, 0])
    assert batch.is_sealed()
    batch.input_ids = batch.input_ids.clone()
    assert not batch.is_sealed()
    batch.prepare_decode(world.req_pool, world.kv_alloc)
    assert batch.is_sealed()
    batch.merge(DecodeBatch.empty("cpu", world.cfg.max_context_len))
    assert batch.is_sealed()


def test_a_sealed_batch_skips_the_per_field_checks_and_an_unsealed_one_is_checked():
    world = ToyWorld()
    runner = _runner(world)
    gate = runner.input_gate
    for seed in range(3):
        runner.replay(world.make_batch(3, seed=seed))
    assert gate.full_checks == 0
    batch = world.make_batch(3, seed=4)
    batch.seq_lens = batch.seq_lens.to(torch.int32)  # from outside: the seal breaks
    before = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    with pytest.raises(PopulateError, match=r"'seq_lens' has dtype torch.int32"):
        runner.replay(batch)
    _assert_unchanged(runner, before)
    assert gate.full_checks == 0  # it failed: nothing remembered


def test_a_foreign_object_is_checked_in_full_on_every_replay():
    world = ToyWorld()
    runner = _runner(world)
    gate = runner.input_gate
    inputs = _foreign(world.make_batch(3, seed=0))
    for count in (1, 2, 3):  # the same tensors: no tier of trust by identity
        runner.replay(inputs)
        assert gate.full_checks == count


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("positions", lambda t: t.float(), r"'positions' has dtype torch.float32"),
        ("out_cache_loc", lambda t: t[:2], r"'out_cache_loc' has shape \(2,\)"),
        ("input_ids", lambda t: t.tolist(), r"'input_ids' must be a torch.Tensor"),
        ("seq_lens_cpu", lambda t: t[:1], r"host mirror 'seq_lens_cpu'"),
        ("req_pool_indices_cpu", lambda t: t * 0, r"req_pool_indices_cpu\[0\]=0"),
    ],
)
def test_a_bad_field_after_a_good_replay_is_still_refused_before_any_write(
    field: str, value, message: str
):
    world = ToyWorld()
    runner = _runner(world)
    inputs = _foreign(world.make_batch(3, seed=0))
    runner.replay(inputs)
    setattr(inputs, field, value(getattr(inputs, field)))
    before = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    with pytest.raises(PopulateError, match=message):
        runner.replay(inputs)
    _assert_unchanged(runner, before)


def test_the_same_tensors_at_another_batch_size_are_checked_in_full():
    world = ToyWorld()
    runner = _runner(world)
    inputs = _foreign(world.make_batch(3, seed=0))
    runner.replay(inputs)
    inputs.batch_size = 2  # the tensors still hold 3 rows
    with pytest.raises(PopulateError, match=r"shape \(2,\)"):
        runner.replay(inputs)


def test_a_sanitized_runner_checks_every_replay_in_full():
    world = ToyWorld()
    runner = _runner(world, sanitized=True)
    gate = runner.input_gate
    batch = world.make_batch(3, seed=0)
    for _ in range(3):
        runner.replay(batch)
    assert gate.full_checks == 3


@pytest.mark.cuda
def test_a_batch_made_on_plain_cuda_takes_the_sealed_path_of_a_cuda_runner():
    """``device="cuda"`` is bound to the current device's index at
    construction, so the batch's device equals the buffers' exactly."""
    from graphrunner import CudaGraphRunner

    world = ToyWorld("cuda")
    runner = CudaGraphRunner(
        world.model, decode_buffer_specs(), capture_sizes=[4], show_progress=False
    )
    runner.capture()
    batch = world.make_batch(3, seed=0)
    assert batch.device == runner.device
    runner.replay(batch)
    runner.replay(batch)
    assert runner.input_gate.full_checks == 0


def test_a_batch_knows_its_host_ranges_and_drops_them_when_a_mirror_changes():
    world = ToyWorld()
    batch = world.make_batch(5, seed=3)
    for name in ("req_pool_indices_cpu", "seq_lens_cpu"):
        mirror = getattr(batch, name)
        assert batch.host_range(name) == (int(mirror.min()), int(mirror.max()))
    batch.filter([4, 0])  # an operation without host ints at hand: computed on demand
    assert batch.host_range("seq_lens_cpu") == (
        int(batch.seq_lens_cpu.min()),
        int(batch.seq_lens_cpu.max()),
    )
    batch.seq_lens_cpu[0] = 999  # in place: the version counter moves
    assert batch.host_range("seq_lens_cpu")[1] == 999
    assert DecodeBatch.empty("cpu", 8).host_range("seq_lens_cpu") is None


def test_the_model_backend_refuses_a_mirror_changed_in_place_in_a_sealed_batch():
    from graphrunner_ref.engine.loop import create_decode_runner
    from graphrunner_ref.model import default_model

    bundle = default_model(max_requests=4, max_context_len=16)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2])
    runner.capture()
    reqs = bundle.req_pool.alloc(2)
    batch = DecodeBatch.from_requests(
        reqs, [3, 4], torch.tensor([1, 2]), device="cpu", max_context_len=16
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    runner.replay(batch)  # fine as made
    batch.seq_lens_cpu[1] = 17  # past the backend's context, seal intact
    assert batch.is_sealed()
    kv_before = [t.clone() for t in bundle.kv_cache.k_buffers]
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[1\]=17: expected 1..16"):
        runner.replay(batch)
    assert all(torch.equal(a, b) for a, b in zip(kv_before, bundle.kv_cache.k_buffers, strict=True))


def _sampled_runner(world: ToyWorld) -> GraphRunner:
    phase = decode_phase(world.model, sampling=True)  # its logits, then the sampler
    runner = create_runner(phase, device="cpu", kind="eager", capture_sizes=[4])
    runner.capture()
    return runner


def test_sampling_rows_beside_a_sealed_batch_are_checked_once_where_the_step_is_made():
    world = ToyWorld()
    runner = _sampled_runner(world)
    batch = world.make_batch(3, seed=0)
    rows = sampling_tensors([SamplingParams(temperature=1.0, seed=7)] * 3, [1, 2, 3], "cpu")
    step = with_sampling(batch, rows)
    assert step.sealed and step.host_range("seq_lens_cpu") == batch.host_range("seq_lens_cpu")
    unsealed = with_sampling(_foreign(batch), rows)  # the same tensors, never sealed
    assert not unsealed.sealed
    assert torch.equal(runner.replay(step)["tokens"], runner.replay(unsealed)["tokens"])
    assert runner.input_gate.full_checks == 1  # the unsealed step's
    bad = with_sampling(batch, {**rows, "top_k": rows["top_k"].float()})
    assert not bad.sealed  # rows that do not fit: the replay names the field
    before = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    with pytest.raises(PopulateError, match=r"'top_k' has dtype torch.float32"):
        runner.replay(bad)
    _assert_unchanged(runner, before)


def test_a_base_without_its_fields_as_attributes_is_refused_by_name():
    rows = sampling_tensors([SamplingParams()], [1], "cpu")
    with pytest.raises(TypeError, match=r"base: a int has no tensors\(\)"):
        with_sampling(3, rows)


class _Wrapper:
    """A batch's attributes handed through, one field its own: its seal is the batch's."""

    def __init__(self, batch: DecodeBatch, positions: torch.Tensor) -> None:
        self._batch, self.positions = batch, positions

    def __getattr__(self, name: str) -> object:
        return getattr(self._batch, name)


def test_a_wrapper_handing_a_sealed_batch_through_is_checked_in_full():
    world = ToyWorld()
    runner = _runner(world)
    batch = world.make_batch(3, seed=0)
    assert batch.sealed and _Wrapper(batch, batch.positions).sealed  # the batch's word
    runner.replay(_Wrapper(batch, batch.positions))
    assert runner.input_gate.full_checks == 1
    before = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    with pytest.raises(PopulateError, match=r"'positions' has dtype torch.float32"):
        runner.replay(_Wrapper(batch, batch.positions.float()))
    _assert_unchanged(runner, before)
