"""TP = 1 through the collectives: one rank in a process group of its own
(gloo on the CPU, NCCL on CUDA) runs the sharded model's all-reduces and
all-gather, compiled and captured as TP = N runs them, and gives the tokens
of the model built without a group."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import graphrunner_ref.model.parallel as parallel
from graphrunner_ref.engine.launch import join_group
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request, synthetic_trace
from graphrunner_ref.model import default_model
from graphrunner_ref.model.llama import use_small_batch_linears
from graphrunner_ref.model.parallel import SINGLE, TensorParallel

ALONE = TensorParallel(0, 1, communicate_alone=True)


def _trace() -> list[Request]:
    return synthetic_trace(
        num_requests=5, vocab_size=256, max_context_len=64, seed=3, prompt_len=(1, 9),
        new_tokens=(2, 7), mean_gap=1.0,
    )  # fmt: skip


@pytest.fixture
def group_of_one(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[None]:
    """This process as rank 0 of a group of one (``param``: the backend)."""
    backend = getattr(request, "param", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(0)
    threads = torch.get_num_threads()
    join_group(0, 1, tmp_path / "store", backend=backend)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _tokens(
    tp: TensorParallel, kind: str, sizes: list[int], device: str = "cpu", **options: object
) -> dict[int, list[int]]:
    bundle = default_model(max_requests=4, max_context_len=64, tp=tp, device=device)
    runner = create_decode_runner(bundle, kind, capture_sizes=sizes, check_padding=True, **options)
    runner.capture()
    return Engine(bundle, runner).run(_trace()).outputs


def count_collectives(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the functional collectives the model calls (traced or eager)."""
    calls = {"all_reduce": 0, "all_gather": 0}
    reduce, gather = parallel.funcol.all_reduce, parallel._all_gather

    def counted_reduce(*args: object) -> torch.Tensor:
        calls["all_reduce"] += 1
        return reduce(*args)  # type: ignore[arg-type]

    def counted_gather(*args: object) -> torch.Tensor:
        calls["all_gather"] += 1
        return gather(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(parallel.funcol, "all_reduce", counted_reduce)
    monkeypatch.setattr(parallel, "_all_gather", counted_gather)
    return calls


def test_alone_is_a_property_of_one_rank_without_communication() -> None:
    assert SINGLE.alone and not ALONE.alone and not TensorParallel(0, 2).alone
    x = torch.randn(3)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x
    with pytest.raises(ValueError, match=r"communicate_alone=1: expected a bool"):
        TensorParallel(0, 1, communicate_alone=1)  # type: ignore[arg-type]


def test_without_a_group_communicating_alone_names_the_missing_group() -> None:
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(RuntimeError, match=r"no process group: expected torch.distributed"):
        ALONE.all_reduce(torch.ones(2))


@pytest.mark.usefixtures("group_of_one")
def test_eager_tokens_through_the_collectives_equal_no_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    whole = _tokens(SINGLE, "eager", [1, 2, 4])
    calls = count_collectives(monkeypatch)
    assert _tokens(ALONE, "eager", [1, 2, 4]) == whole
    # Each step: the embedding's and two a layer's all-reduces, the logits' gather.
    assert calls["all_reduce"] > 0 and calls["all_gather"] > 0
    assert calls["all_reduce"] == calls["all_gather"] * 5  # 2 layers x 2 + the embedding


def _decode_logits(tp: TensorParallel) -> torch.Tensor:
    """One decode step of 2 rows over seeded random K/V, through the small-batch linears."""
    bundle = default_model(max_requests=2, max_context_len=16, tp=tp)
    use_small_batch_linears(bundle.model, 2)  # interpreted on the CPU: one step only
    gen, rows = torch.Generator().manual_seed(4), 2
    bundle.req_pool.req_to_token[1:3, :4] = torch.arange(1, 9).view(rows, 4)
    for layer in bundle.kv_cache.k_buffers + bundle.kv_cache.v_buffers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    batch = SimpleNamespace(
        input_ids=torch.tensor([7, 200]), positions=torch.full((rows,), 4),
        out_cache_loc=torch.tensor([11, 12]), req_pool_indices=torch.tensor([1, 2]),
        seq_lens=torch.full((rows,), 5),
    )  # fmt: skip
    bundle.req_pool.req_to_token[1:3, 4] = batch.out_cache_loc.to(torch.int32)
    with torch.no_grad():
        return bundle.model.forward_decode(batch)


@pytest.mark.usefixtures("group_of_one")
def test_small_batch_linears_add_the_residual_after_the_all_reduce(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the collectives the o and down products' residual add follows
    the all-reduce (alone it is the kernel's epilogue): the same logits."""
    whole = _decode_logits(SINGLE)
    calls = count_collectives(monkeypatch)
    torch.testing.assert_close(_decode_logits(ALONE), whole, rtol=0, atol=1e-6)
    assert calls["all_reduce"] == 5 and calls["all_gather"] == 1  # one step, 2 layers


def _collective_ops(run: Callable[[], object]) -> set[str]:
    """The functional collectives' ops ``run`` executes (by the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return {e.name for e in prof.events() if "_c10d_functional::" in e.name}


@pytest.mark.usefixtures("group_of_one")
def test_compiled_cpu_programs_hold_the_collectives_and_equal_no_group() -> None:
    whole = _tokens(SINGLE, "eager", [4])
    bundle = default_model(max_requests=4, max_context_len=64, tp=ALONE)
    runner = create_decode_runner(bundle, "cpu", capture_sizes=[4], check_padding=True)
    runner.capture()
    found: dict[int, list[int]] = {}
    ops = _collective_ops(lambda: found.update(Engine(bundle, runner).run(_trace()).outputs))
    assert found == whole
    assert {"_c10d_functional::all_reduce_", "_c10d_functional::all_gather_into_tensor"} <= ops
    programs = runner.mechanism.programs(4)
    assert programs is not None and programs - runner.direct_fallbacks == 1  # no graph break


@pytest.mark.cuda
@pytest.mark.parametrize("group_of_one", ["nccl"], indirect=True)
@pytest.mark.usefixtures("group_of_one")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graphs_capture_the_nccl_collectives_token_exact(
    compile: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = _tokens(SINGLE, "cuda", [1, 2, 4], "cuda", compile=compile)
    calls = count_collectives(monkeypatch)
    bundle = default_model(max_requests=4, max_context_len=64, tp=ALONE, device="cuda")
    runner = create_decode_runner(
        bundle, "cuda", capture_sizes=[1, 2, 4], check_padding=True, compile=compile
    )
    runner.capture()
    assert calls["all_reduce"] > 0 and calls["all_gather"] > 0  # in the captured forward
    replay, replays = runner.replay, []

    def replay_in_graph(*args: object, **kwargs: object) -> object:
        before = dict(calls)  # prefill runs eagerly, its collectives called from Python
        out = replay(*args, **kwargs)
        assert calls == before  # the graph's own collectives ran, none from Python
        replays.append(out)
        return out

    monkeypatch.setattr(runner, "replay", replay_in_graph)
    assert Engine(bundle, runner).run(_trace()).outputs == whole
    assert replays
