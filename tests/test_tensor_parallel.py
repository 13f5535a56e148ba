"""Tensor parallelism on the CPU: the default model sharded over two gloo ranks
gives the tokens of the whole model in one process."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphrunner_ref.engine.launch import join_group, run_ranks
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.ranks import replay_size_check
from graphrunner_ref.engine.spec_factory import speculative_engine
from graphrunner_ref.engine.workload import Request, synthetic_trace
from graphrunner_ref.model import default_config, default_model
from graphrunner_ref.model.parallel import (
    SINGLE,
    TensorParallel,
    kv_head_range,
    local_config,
    shard_weights,
)

MAX_BS = 4
WORLD = 2


def _trace() -> list[Request]:
    return synthetic_trace(
        num_requests=6,
        vocab_size=256,
        max_context_len=256,
        seed=5,
        prompt_len=(1, 12),
        new_tokens=(2, 8),
        mean_gap=1.0,
    )


#: Capture sizes per runner kind: the CPU runner compiles one (a cold compile
#: of a sharded size takes 20-30 s), every batch of 1..4 rows padded to it.
SIZES = {"eager": [1, 2, 4], "cpu": [4]}
#: The models the sharded runs cover: the default (2 KV heads, one per rank),
#: one KV head (replicated on both ranks) with tied embeddings, and a
#: vocabulary of 301 tokens, which 2 ranks cannot split evenly (padded).
CONFIGS = {
    "default": None,
    "one_kv_head": dataclasses.replace(default_config(), num_kv_heads=1, tie_word_embeddings=True),
    "odd_vocab": dataclasses.replace(default_config(), vocab_size=301),
}

Found = tuple[dict[int, list[int]], list[int]]


def _generate(tp: TensorParallel, kind: str, model: str) -> Found:
    """Greedy tokens by request id, padded, with the sanitizer and the eager
    check on every step; and the CPU runner's inductor programs per size (one
    each: the collectives compiled inside, no graph break) minus its sizes
    launched through dynamo (none)."""
    bundle = default_model(max_requests=MAX_BS, tp=tp, config=CONFIGS[model])
    runner = create_decode_runner(bundle, kind, capture_sizes=SIZES[kind], check_padding=True)
    runner.capture()
    tokens = Engine(bundle, runner, check=True).run(_trace()).outputs
    programs = [runner.mechanism.programs(bs) for bs in SIZES[kind]]
    return tokens, [p - runner.direct_fallbacks for p in programs if p is not None]


def _rank_generate(
    rank: int, world: int, store: Path, out: Path, kind: str, models: list[str]
) -> None:
    join_group(rank, world, store)
    try:
        found = {m: _generate(TensorParallel(rank, world), kind, m) for m in models}
        (out / f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def _sharded(tmp_path: Path, kind: str, models: list[str]) -> list[dict[str, Found]]:
    """Each rank's :func:`_generate` of each model, on ``WORLD`` gloo ranks."""
    run_ranks(_rank_generate, WORLD, WORLD, tmp_path / "store", tmp_path, kind, models)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return [
        {
            m: ({int(k): v for k, v in tokens.items()}, programs)
            for m, (tokens, programs) in f.items()
        }
        for f in found
    ]


def test_sharded_eager_decode_equals_one_process(tmp_path: Path) -> None:
    ranks = _sharded(tmp_path, "eager", list(CONFIGS))
    for model in CONFIGS:
        whole, _ = _generate(SINGLE, "eager", model)
        assert all(r[model][0] == whole for r in ranks), model


def _rank_raises(rank: int, world: int, store: Path) -> None:
    join_group(rank, world, store)
    if rank == 1:
        raise ValueError("rank 1 gave up")
    TensorParallel(rank, world).all_reduce(torch.ones(2))  # rank 0 waits for rank 1


def test_a_rank_raising_ends_the_run_with_its_error(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 gave up"):
        run_ranks(_rank_raises, WORLD, WORLD, tmp_path / "store", timeout_s=60.0)


def _rank_dies(rank: int, world: int, store: Path) -> None:
    join_group(rank, world, store)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no exception, no goodbye
    TensorParallel(rank, world).all_reduce(torch.ones(2))  # rank 0 waits for rank 1


def test_a_killed_rank_ends_the_run(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with signal"):
        run_ranks(_rank_dies, WORLD, WORLD, tmp_path / "store", timeout_s=60.0)


def _rank_capture_sizes(rank: int, world: int, store: Path) -> None:
    join_group(rank, world, store)
    bundle = default_model(max_requests=MAX_BS, tp=TensorParallel(rank, world))
    create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4] if rank == 0 else [1, 2])


def test_ranks_with_different_capture_sizes_are_refused_naming_both(tmp_path: Path) -> None:
    expected = (
        r"capture sizes differ across tensor-parallel ranks: rank 0 \[1, 2, 4\], rank 1 \[1, 2\]"
    )
    with pytest.raises(mp.ProcessRaisedException, match=expected):
        run_ranks(_rank_capture_sizes, WORLD, WORLD, tmp_path / "store", timeout_s=60.0)


def _rank_replay_sizes(rank: int, world: int, store: Path) -> None:
    join_group(rank, world, store)
    bundle = default_model(max_requests=MAX_BS, tp=TensorParallel(rank, world))
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
    check = replay_size_check(bundle, runner)
    assert check is not None
    check(2 + rank)  # rank 0 replays 2 rows at size 2, rank 1 3 rows at size 4


def test_sanitized_replays_of_different_sizes_are_an_error_naming_both(tmp_path: Path) -> None:
    expected = r"replay sizes \[raw, padded\] differ .*: rank 0 \[2, 2\], rank 1 \[3, 4\]"
    with pytest.raises(mp.ProcessRaisedException, match=expected):
        run_ranks(_rank_replay_sizes, WORLD, WORLD, tmp_path / "store", timeout_s=60.0)


def test_replay_sizes_go_unchecked_alone() -> None:
    bundle = default_model(max_requests=MAX_BS)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
    assert replay_size_check(bundle, runner) is None


def test_speculative_decoding_refuses_a_shard() -> None:
    bundle = default_model(max_requests=MAX_BS, tp=TensorParallel(0, WORLD))
    with pytest.raises(ValueError, match="speculative decoding .*tp.world=2"):
        speculative_engine(bundle, "eager")


@pytest.mark.parametrize("vocab", [256, 301])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shards_put_back_together_are_the_whole(world: int, vocab: int) -> None:
    config = dataclasses.replace(default_config(), vocab_size=vocab)
    whole = default_model(max_requests=1, max_context_len=1, config=config).model.state_dict()
    shards = [shard_weights(whole, config, TensorParallel(r, world)) for r in range(world)]
    d = config.head_dim
    for name, tensor in whole.items():
        parts = [s[name] for s in shards]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), tensor), name
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            heads = [kv_head_range(config, TensorParallel(r, world)) for r in range(world)]
            for part, (first, count) in zip(parts, heads, strict=True):
                assert torch.equal(part, tensor[first * d : (first + count) * d]), name
        elif "norm" in name:
            assert all(torch.equal(p, tensor) for p in parts), name
        else:  # by vocabulary row, padded with zero rows past it
            rows = -(-vocab // world) if "embed" in name or "lm_head" in name else None
            assert rows is None or all(p.shape[0] == rows for p in parts), name
            joined = torch.cat(parts, 0)
            assert torch.equal(joined[: tensor.shape[0]], tensor), name
            assert not joined[tensor.shape[0] :].any(), name


def test_kv_heads_are_replicated_when_fewer_than_ranks() -> None:
    config = default_config()  # 4 query heads, 2 KV heads
    heads = [kv_head_range(config, TensorParallel(r, 4)) for r in range(4)]
    assert heads == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert local_config(config, TensorParallel(0, 4)).num_heads == 1


def test_unshardable_sizes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="num_heads=4: expected a multiple"):
        local_config(default_config(), TensorParallel(0, 3))
    with pytest.raises(ValueError, match="rank=2: expected 0..world - 1 = 1"):
        TensorParallel(2, 2)


def test_sharded_cpu_runner_equals_one_process(tmp_path: Path) -> None:
    """torch.compile over gloo: each size one inductor program with its
    collectives inside, called directly; tokens the eager TP=1 engine's."""
    whole, _ = _generate(SINGLE, "eager", "default")
    for found in _sharded(tmp_path, "cpu", ["default"]):
        tokens, programs = found["default"]
        assert tokens == whole
        assert programs == [1] * len(SIZES["cpu"])
