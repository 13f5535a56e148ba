"""One replay path: the eager fallback runs the checks and backend validation
a graph replay runs; host mirrors are checked on the host before anything is
written; outputs are valid until the next replay on every mechanism (a
sanitized runner poisons held outputs, so holding one fails on the CPU too)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import make_runner
from graphrunner import create_runner, decode_buffer_specs
from graphrunner.sanitizer.padding import PaddingSanitizer
from graphrunner.testing import ToyWorld
from graphrunner.writers import PopulateError
from graphrunner_ref.engine.loop import create_decode_runner
from graphrunner_ref.model import default_model


def sanitized(label: str, world: ToyWorld, forward: object = None) -> object:
    sanitizer = PaddingSanitizer.for_pools(world.req_pool, world.kv, kv_allocator=world.kv_alloc)
    return make_runner(
        label,
        forward or world.model,
        decode_buffer_specs(),
        capture_sizes=[2, 4],
        sanitizer=sanitizer,
    )


@pytest.mark.parametrize("label", ["eager", "cpu"])
def test_a_held_output_is_poisoned_by_the_next_sanitized_replay(label: str):
    world = ToyWorld()
    runner = sanitized(label, world)
    runner.capture()  # type: ignore[attr-defined]
    first = world.make_batch(3, seed=0)
    expected, _ = world.eager_reference(first)
    held = runner.replay(first)  # type: ignore[attr-defined]
    torch.testing.assert_close(held, expected)
    runner.replay(world.make_batch(2, seed=1))  # type: ignore[attr-defined]
    assert torch.isnan(held).all(), "the previous step's outputs must not survive"


def test_the_eager_fallback_poisons_and_is_poisoned_too():
    world = ToyWorld()
    runner = sanitized("eager", world)
    runner.capture()  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        big = runner.replay(world.make_batch(5, seed=2))  # type: ignore[attr-defined]
        small = runner.replay(world.make_batch(1, seed=3))  # type: ignore[attr-defined]
        assert torch.isnan(big).all()
        runner.replay(world.make_batch(6, seed=4))  # type: ignore[attr-defined]
    assert torch.isnan(small).all()


def test_outputs_that_are_the_next_steps_inputs_are_spared():
    """An output fed back as the next step's input (a forward returning its
    own input here) is read by the next step: it is not poisoned."""
    world = ToyWorld()

    def echo(b: object) -> dict[str, torch.Tensor]:
        return {"logits": world.model(b), "ids": b.input_ids}  # type: ignore[attr-defined]

    runner = sanitized("eager", world, echo)
    runner.capture()  # type: ignore[attr-defined]
    batch = world.make_batch(2, seed=5)
    out = runner.replay(batch)  # type: ignore[attr-defined]
    ids = out["ids"]
    assert ids.data_ptr() != batch.input_ids.data_ptr()  # a view of the static buffer
    out = runner.replay(batch)  # type: ignore[attr-defined]
    assert torch.equal(out["ids"], batch.input_ids)


def test_unsanitized_cpu_outputs_are_left_alone():
    world = ToyWorld()
    runner = make_runner("eager", world.model, decode_buffer_specs(), capture_sizes=[2])
    runner.capture()
    held = runner.replay(world.make_batch(2, seed=6)).clone()
    kept = runner.replay(world.make_batch(2, seed=6))
    runner.replay(world.make_batch(1, seed=7))
    assert torch.isfinite(kept).all() and torch.equal(kept, held)  # nothing paid without it


def _toy_batch_fields(world: ToyWorld, raw_bs: int) -> SimpleNamespace:
    batch = world.make_batch(raw_bs, seed=8)
    fields = {s.name: getattr(batch, s.name) for s in decode_buffer_specs()}
    return SimpleNamespace(
        **fields,
        batch_size=raw_bs,
        req_pool_indices_cpu=batch.req_pool_indices_cpu,
        seq_lens_cpu=batch.seq_lens_cpu,
    )


@pytest.mark.parametrize(
    ("mirror", "value", "message"),
    [
        ("seq_lens_cpu", [3, 4], "'seq_lens_cpu' is a list"),
        ("seq_lens_cpu", torch.tensor([3.0, 4.0]), r"torch.float32 \(2,\) on cpu"),
        ("seq_lens_cpu", torch.tensor([3]), r"torch.int64 \(1,\) on cpu"),
        ("seq_lens_cpu", torch.tensor([3, 4], device="meta"), "on meta"),
        ("req_pool_indices_cpu", torch.tensor([], dtype=torch.int64), r"\(0,\)"),
        ("req_pool_indices_cpu", torch.tensor([2, 0]), r"req_pool_indices_cpu\[1\]=0"),
    ],
)
@pytest.mark.parametrize("raw_bs_path", ["graph", "eager fallback"])
def test_host_mirrors_are_checked_before_anything_is_written(
    mirror: str, value: object, message: str, raw_bs_path: str
):
    world = ToyWorld()
    runner = create_runner(
        world.model,
        decode_buffer_specs(),
        device="cpu",
        capture_sizes=[1 if raw_bs_path == "eager fallback" else 2],
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    inputs = _toy_batch_fields(world, 2)
    setattr(inputs, mirror, value)
    buffers_before = {n: t.clone() for n, t in runner.buffers.tensors.items()}
    state_before = world.state()
    with pytest.raises(PopulateError, match=message), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.replay(inputs)
    for name, t in runner.buffers.tensors.items():
        assert torch.equal(t, buffers_before[name]), name
    for name, t in world.state().items():
        assert torch.equal(t, state_before[name]), name
    assert runner.stats.replays == runner.stats.eager_fallbacks == 0


def test_the_eager_fallback_runs_the_backends_validation():
    """A seq_lens_cpu of 0 would give NaN logits, one beyond the context a
    silently truncated read: refused on the fallback as on a graph replay."""
    bundle = default_model(max_requests=4, max_context_len=32)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1])
    runner.capture()
    rows = bundle.req_pool.alloc(2)
    ids = torch.tensor([1, 2])
    for seq_len, message in ((0, r"seq_lens_cpu\[0\]=0: expected 1..32"), (33, "=33")):
        batch = SimpleNamespace(
            batch_size=2,
            input_ids=ids,
            req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor([seq_len, 2]),
            out_cache_loc=torch.tensor([5, 6]),
            positions=torch.tensor([seq_len - 1, 1]),
            req_pool_indices_cpu=torch.tensor(rows),
            seq_lens_cpu=torch.tensor([seq_len, 2]),
        )
        with pytest.raises(ValueError, match=message), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner.replay(batch)
    assert runner.stats.eager_fallbacks == 0
