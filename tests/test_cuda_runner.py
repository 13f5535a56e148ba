"""CUDA-only properties of the CUDA runner (skipped without a device): one
shared pool, graph memory measured on the pool, no sync in replay, and a
compiled forward inside the graphs that equals eager."""

from __future__ import annotations

import pytest
import torch

from conftest import MECHANISMS, CapturedToy, make_runner, runner_device
from graphrunner import CudaGraphRunner, create_runner, decode_buffer_specs
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner_ref.engine.loop import create_decode_runner
from graphrunner_ref.model import default_model

CUDA_LABELS = ["cuda", "cuda+compile"]


@pytest.mark.cuda
@pytest.mark.parametrize("label", CUDA_LABELS)
def test_graphs_share_one_pool_and_capture_largest_first(label: str):
    runner = CapturedToy(label, [1, 2, 4, 8]).runner
    assert isinstance(runner, CudaGraphRunner)
    pools = {graph.pool() for graph in runner.graphs.values()}
    assert len(pools) == 1
    assert [s.bs for s in runner.capture_report.sizes] == [8, 4, 2, 1]
    assert all(s.memory_bytes is not None for s in runner.capture_report.sizes)
    compiled = label == "cuda+compile"
    assert [s.programs for s in runner.capture_report.sizes] == [1 if compiled else None] * 4


@pytest.mark.cuda
def test_capture_memory_is_the_pools_and_smaller_sizes_reuse_it():
    """The largest size reports at least an intermediate its forward is known
    to allocate; the others, captured after it, reuse the shared pool."""
    width = 1 << 18  # floats per row of the intermediate: 1 MiB per row

    def forward(b: object) -> torch.Tensor:
        rows = b.input_ids.float()[:, None]  # type: ignore[attr-defined]
        wide = rows * torch.ones(width, device=rows.device)  # [bs, width], graph-pool memory
        return wide.sum(1)

    sizes = [1, 2, 4, 8]
    runner = make_runner("cuda", forward, decode_buffer_specs(), capture_sizes=sizes)
    report = runner.capture()
    memory = {s.bs: s.memory_bytes for s in report.sizes}
    assert all(m is not None and m >= 0 for m in memory.values()), memory
    largest = memory[8]
    assert largest is not None and largest >= 8 * width * 4, memory
    total = report.total_memory_bytes
    assert total is not None and total <= 1.1 * largest, memory


@pytest.mark.cuda
@pytest.mark.parametrize("label", CUDA_LABELS)
def test_padded_replay_does_not_sync(label: str):
    toy = CapturedToy(label, [1, 2, 4, 8])
    batches = [toy.world.make_batch(n, seed=n) for n in (3, 5, 7)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            toy.runner.replay(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("label", ["cpu", pytest.param("cuda+compile", marks=pytest.mark.cuda)])
def test_compiled_forward_matches_eager_on_the_reference_model(label: str):
    """fp32: logits within 1e-4 of the eager forward, tokens equal, at every
    raw size 1..8 (most of them padded). On CUDA: inductor programs inside
    CUDA graphs; on the CPU: the same programs called directly."""
    device = runner_device(label)
    kind, options = MECHANISMS[label]
    bundle = default_model(max_requests=8, device=device, max_context_len=64)
    runner = create_decode_runner(bundle, kind, capture_sizes=[1, 2, 4, 8], **options)
    report = runner.capture()
    assert [s.programs for s in report.sizes] == [1, 0, 0, 0] and runner.direct_fallbacks == 0
    assert runner.compilations == 1  # one program serves every size
    model, gen = bundle.model, torch.Generator().manual_seed(0)
    for raw_bs in range(1, 9):
        bundle.req_pool.clear()
        bundle.kv_alloc.clear()
        rows = bundle.req_pool.alloc(raw_bs)
        lens = torch.randint(1, 40, (raw_bs,), generator=gen).tolist()
        for row, n in zip(rows, lens, strict=True):
            slots = torch.tensor(bundle.kv_alloc.alloc(n), device=device)
            prompt = torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(device)
            model.forward_extend(row, prompt, slots)
        ids = torch.randint(0, model.config.vocab_size, (raw_bs,), generator=gen).to(device)
        batch = DecodeBatch.from_requests(
            rows, lens, ids, device=device, max_context_len=bundle.max_context_len
        )
        batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
        with torch.no_grad():
            expected = model.forward_decode(batch).clone()
        got = runner.replay(batch)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), raw_bs


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_runner_refuses_inductor_cuda_graph_modes(mode: str):
    with pytest.raises(ValueError, match=f"compile_mode='{mode}' turns on inductor's own"):
        create_runner(
            lambda v: v,
            decode_buffer_specs(),
            max_bs=2,
            compile=True,
            compile_mode=mode,
            kind="cuda",
        )
    with pytest.raises(ValueError, match="apply only with compile=True"):
        create_runner(
            lambda v: v, decode_buffer_specs(), max_bs=2, compile_mode="default", kind="cuda"
        )


def test_cuda_runner_refuses_without_a_device():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaGraphRunner(lambda v: v, decode_buffer_specs(), device="cpu", max_bs=4)
