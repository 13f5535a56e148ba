"""Overlap scheduling: a future-token map indexed by request-pool row,
resolved inside populate; the overlap engine gives the plain engine's tokens."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from conftest import MECHANISMS, RUNNER_PARAMS, runner_device
from graphrunner import create_runner, decode_buffer_specs
from graphrunner.core.future_map import FutureMap, future_refs
from graphrunner.declare import StaticBuffers
from graphrunner.testing import ToyWorld
from graphrunner.writers import populate
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import synthetic_trace
from graphrunner_ref.model import default_model

ROWS = 9


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", ["flat", "column"])
def test_store_takes_both_shapes_and_dtypes_at_the_request_rows(dtype: torch.dtype, shape: str):
    future = FutureMap(ROWS, "cpu")
    tokens = torch.tensor([11, 22, 33], dtype=dtype)
    future.store(torch.tensor([5, 2, 7]), tokens[:, None] if shape == "column" else tokens)
    expected = torch.zeros(ROWS, dtype=torch.int64)
    expected[[5, 2, 7]] = torch.tensor([11, 22, 33])
    assert torch.equal(future.tokens, expected) and future.tokens.dtype == torch.int64


def test_an_empty_store_is_a_no_op_and_bad_stores_are_named():
    future = FutureMap(ROWS, "cpu")
    future.store(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert not future.tokens.any()
    with pytest.raises(ValueError, match=r"expected \[bs\] and int32/int64"):
        future.store(torch.tensor([1, 2]), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"expected \[bs\]"):
        future.store(torch.tensor([1, 2]), torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="must be tensors"):
        future.store([1], torch.tensor([1]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_rows=1"):
        FutureMap(1, "cpu")
    assert not future.tokens.any()


def _buffers(future: FutureMap) -> StaticBuffers:
    return StaticBuffers(decode_buffer_specs(future=True), 8, "cpu", future_tokens=future.tokens)


def _inputs(ids: list[int]) -> SimpleNamespace:
    n = len(ids)
    one = torch.ones(n, dtype=torch.int64)
    return SimpleNamespace(
        input_ids=torch.tensor(ids),
        req_pool_indices=one * 3,
        seq_lens=one,
        out_cache_loc=one,
        positions=one * 0,
    )


def test_populate_resolves_references_and_padded_rows_never_read_a_live_row():
    future = FutureMap(ROWS, "cpu")
    future.store(torch.tensor([3, 4]), torch.tensor([40, 50]))
    bufs = _buffers(future)
    bufs.tensors["input_ids"].fill_(-4)  # stale references in the tail
    ops = populate(bufs, _inputs([-3, 17, -4]), 3, 8)
    assert bufs.tensors["input_ids"].tolist() == [40, 17, 50, 0, 0, 0, 0, 0]
    assert ops == 1 + 1  # the decode fields' one staged copy, and one resolve


def test_a_reused_row_reads_its_own_token_never_its_predecessors():
    future = FutureMap(ROWS, "cpu")
    future.store(torch.tensor([5]), torch.tensor([99]))  # the predecessor's last token
    future.store(torch.tensor([5]), torch.tensor([7]))  # the new request's first token
    bufs = _buffers(future)
    populate(bufs, _inputs([-5]), 1, 2)
    assert bufs.tensors["input_ids"][:2].tolist() == [7, 0]


def test_future_buffers_and_the_map_go_together():
    with pytest.raises(
        ValueError, match="future=True: \\['input_ids'\\]; a future map was not given"
    ):
        StaticBuffers(decode_buffer_specs(future=True), 4, "cpu")
    with pytest.raises(ValueError, match="future=True: \\[\\]; a future map was given"):
        StaticBuffers(
            decode_buffer_specs(), 4, "cpu", future_tokens=torch.zeros(4, dtype=torch.int64)
        )


@pytest.mark.parametrize("label", RUNNER_PARAMS)
def test_every_mechanism_resolves_references_like_tokens(label: str):
    """A batch of references replays exactly as the batch of the tokens they name,
    graph and eager fallback alike."""
    world = ToyWorld(runner_device(label))
    future = FutureMap(world.cfg.num_reqs + 1, world.device)
    kind, options = MECHANISMS[label]
    runner = create_runner_with_future(kind, options, world, future)
    for raw_bs in (3, 5):  # 3 pads to 4; 5 runs eagerly
        batch = world.make_batch(raw_bs, seed=raw_bs)
        expected, _ = world.eager_reference(batch)
        future.store(batch.req_pool_indices, batch.input_ids)
        batch.input_ids = future_refs(batch.req_pool_indices)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = runner.replay(batch)
        torch.testing.assert_close(out, expected)


def create_runner_with_future(
    kind: str, options: dict, world: ToyWorld, future: FutureMap
) -> object:
    from graphrunner import create_runner

    runner = create_runner(
        world.model,
        decode_buffer_specs(future=True),
        device=world.device,
        capture_sizes=[2, 4],
        show_progress=False,
        future_map=future,
        **options,
        kind=kind,
    )
    runner.capture()
    return runner


def _trace() -> list:
    return synthetic_trace(
        num_requests=24,
        vocab_size=256,
        max_context_len=60,
        seed=4,
        prompt_len=(2, 20),
        new_tokens=(1, 24),
        mean_gap=1.5,
    )


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kind", ["eager", "cpu"])
def test_overlap_gives_the_plain_engines_tokens_and_frees_every_slot(kind: str, page_size: int):
    trace = _trace()
    plain_bundle = default_model(max_requests=4, max_context_len=60, page_size=page_size)
    plain_runner = create_decode_runner(plain_bundle, kind, capture_sizes=[2, 4])
    plain_runner.capture()
    # An end token some requests emit mid-way: they finish after the next step was prepared.
    unbounded = Engine(plain_bundle, plain_runner).run(trace).outputs
    end = max(t for tokens in unbounded.values() for t in tokens[1:-1])
    expected = Engine(plain_bundle, plain_runner, end_token=end).run(trace).outputs

    bundle = default_model(max_requests=4, max_context_len=60, page_size=page_size)
    free = (bundle.kv_alloc.available_size(), bundle.req_pool.available_size())
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    runner = create_decode_runner(
        bundle, kind, capture_sizes=[2, 4], future_map=future, check_padding=True
    )
    runner.capture()
    result = Engine(bundle, runner, end_token=end, overlap=True).run(trace)
    assert result.outputs == expected
    assert result.finished == {r.rid for r in trace}
    assert (bundle.kv_alloc.available_size(), bundle.req_pool.available_size()) == free
    cut_short = [r for r in trace if len(expected[r.rid]) < r.max_new_tokens]
    assert cut_short and all(expected[r.rid][-1] == end for r in cut_short)


def test_a_cut_overlap_run_frees_the_step_it_prepared():
    bundle = default_model(max_requests=4, max_context_len=60)
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2, 4], future_map=future)
    runner.capture()
    free = bundle.kv_alloc.available_size()
    result = Engine(bundle, runner, overlap=True).run(_trace(), max_steps=7)
    assert result.stats.steps == 7
    assert bundle.kv_alloc.available_size() == free


def test_the_overlap_engine_needs_a_future_map():
    bundle = default_model(max_requests=2, max_context_len=60)
    runner = create_runner(
        bundle.model.forward_decode, decode_buffer_specs(), device="cpu", max_bs=2, kind="eager"
    )
    with pytest.raises(ValueError, match="the runner has no future map"):
        Engine(bundle, runner, overlap=True)


@pytest.mark.cuda
def test_overlap_syncs_only_at_the_one_wait_per_step(monkeypatch: pytest.MonkeyPatch):
    import graphrunner_ref.engine.overlap_schedule as ov

    bundle = default_model(max_requests=4, max_context_len=60, device="cuda")
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    runner = create_decode_runner(bundle, "cuda", capture_sizes=[2, 4], future_map=future)
    runner.capture()
    real_wait, waits = ov.HostCopy.wait, []

    def wait_allowed(self: object) -> list[int]:
        waits.append(1)
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real_wait(self)  # type: ignore[arg-type]
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(ov.HostCopy, "wait", wait_allowed)
    engine = Engine(bundle, runner, overlap=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = engine.run(_trace())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # One wait per engine iteration (a step, or an admission while idle), no other sync.
    assert result.stats.steps <= len(waits) <= result.stats.steps + len(_trace())


def test_overlap_is_a_schedule_of_the_one_engine():
    trace = _trace()
    outputs = []
    for make in (
        lambda b, r: Engine(b, r, overlap=True),
        lambda b, r: Engine(b, r, overlap=True),
    ):
        bundle = default_model(max_requests=4, max_context_len=60)
        future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
        runner = create_decode_runner(bundle, "eager", capture_sizes=[2, 4], future_map=future)
        runner.capture()
        engine = make(bundle, runner)
        assert type(engine.schedule).__name__ == "OverlapSchedule"
        outputs.append(engine.run(trace).outputs)
    assert outputs[0] == outputs[1]
    plain_bundle = default_model(max_requests=4, max_context_len=60)
    plain_runner = create_decode_runner(plain_bundle, "eager", capture_sizes=[2, 4])
    plain_runner.capture()
    assert Engine(plain_bundle, plain_runner).run(trace).outputs == outputs[0]


def test_overlap_with_check_is_refused():
    bundle = default_model(max_requests=2, max_context_len=60)
    future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2], future_map=future)
    with pytest.raises(ValueError, match="check=True with overlap=True"):
        Engine(bundle, runner, check=True, overlap=True)
