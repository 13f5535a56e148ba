"""Tensor parallelism from a checkpoint: each rank reads its slices of the
safetensors file, and two gloo ranks give transformers' greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graphrunner_ref.engine.launch import join_group, run_ranks
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_any, load_model, read_config
from graphrunner_ref.model import ModelBundle
from graphrunner_ref.model.parallel import TensorParallel, shard_weights
from hf_ssm import save_tiny_mamba
from hf_tiny import hf_greedy, save_tiny_llama

transformers = pytest.importorskip("transformers")

WORLD = 2
CONTEXT = 64
TRACE = [
    Request(0, (5, 17, 200), 6, arrival_step=0),
    Request(1, (9,), 8, arrival_step=0),
    Request(2, tuple(range(30, 51)), 5, arrival_step=1),
    Request(3, (0, 0, 1), 7, arrival_step=3),
    Request(4, (255, 128, 64, 32, 16, 8, 4), 4, arrival_step=4),
]


@pytest.mark.parametrize("tie", [False, True])
def test_each_rank_loads_its_slices_of_the_checkpoint(tmp_path: Path, tie: bool) -> None:
    save_tiny_llama(tmp_path, tie=tie)
    config = read_config(tmp_path)
    whole = load_model(tmp_path, max_requests=1, max_context_len=1).model.state_dict()
    for rank in range(WORLD):
        tp = TensorParallel(rank, WORLD)
        shard = load_model(tmp_path, max_requests=1, max_context_len=1, tp=tp).model.state_dict()
        expected = shard_weights(whole, config, tp)
        assert shard.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(shard[name], tensor), name


def test_load_any_shards_a_llama_and_refuses_a_mamba(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path / "llama")
    tp = TensorParallel(1, WORLD)
    shard = load_any(tmp_path / "llama", max_requests=1, max_context_len=1, tp=tp)
    direct = load_model(tmp_path / "llama", max_requests=1, max_context_len=1, tp=tp)
    assert isinstance(shard, ModelBundle)
    for name, tensor in direct.model.state_dict().items():
        assert torch.equal(shard.model.state_dict()[name], tensor), name
    save_tiny_mamba(tmp_path / "mamba")
    with pytest.raises(
        ValueError, match="tp.world=2: .* holds a mamba model, which is not sharded"
    ):
        load_any(tmp_path / "mamba", max_requests=1, tp=tp)


def _rank_serve(rank: int, world: int, store: Path, path: Path) -> None:
    join_group(rank, world, store)
    try:
        tp = TensorParallel(rank, world)
        bundle = load_model(path, max_requests=4, max_context_len=CONTEXT, tp=tp)
        runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
        runner.capture()
        outputs = Engine(bundle, runner, check=True).run(TRACE).outputs
        (path / f"rank{rank}.json").write_text(json.dumps(outputs))
    finally:
        dist.destroy_process_group()


def test_two_ranks_give_transformers_greedy_tokens(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    expected = {str(rid): t for rid, t in hf_greedy(save_tiny_llama(path), TRACE).items()}
    run_ranks(_rank_serve, WORLD, WORLD, tmp_path / "store", path)
    for rank in range(WORLD):
        assert json.loads((path / f"rank{rank}.json").read_text()) == expected, rank
