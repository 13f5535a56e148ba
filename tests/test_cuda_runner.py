"""CUDA-only properties of the CUDA runner (skipped without a device)."""

from __future__ import annotations

import pytest
import torch

from conftest import CapturedToy


@pytest.mark.cuda
def test_graphs_share_one_pool_and_capture_largest_first():
    toy = CapturedToy("cuda", [1, 2, 4, 8])
    runner = toy.runner
    pools = {graph.pool() for graph in runner.graphs.values()}  # type: ignore[attr-defined]
    assert len(pools) == 1
    assert [s.bs for s in runner.capture_report.sizes] == [8, 4, 2, 1]
    assert all(s.memory_bytes is not None for s in runner.capture_report.sizes)


@pytest.mark.cuda
def test_padded_replay_does_not_sync():
    toy = CapturedToy("cuda", [1, 2, 4, 8])
    batches = [toy.world.make_batch(n, seed=n) for n in (3, 5, 7)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches:
            toy.runner.replay(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_runner_refuses_without_a_device():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from graphrunner import CudaGraphRunner, decode_buffer_specs

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaGraphRunner(lambda v: v, decode_buffer_specs(), device="cpu", max_bs=4)
