"""The external oracle: greedy tokens served by the engine through padded replay
equal transformers' ``generate(do_sample=False)`` of each prompt alone.

A tiny random ``LlamaForCausalLM`` is saved with ``save_pretrained`` and loaded
by graphrunner's loader. Requests of different lengths and budgets arrive at
staggered steps and finish at different ones, so decode steps see every batch
size from 1 to 8, most of them padded up to a captured size (1, 2, 4, 8).
With KV pages of 4 slots, prompts end mid-page and decode steps cross page
boundaries; the tokens must not change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import MECHANISMS, RUNNER_PARAMS, runner_device
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_model
from hf_tiny import hf_greedy, save_tiny_llama

transformers = pytest.importorskip("transformers")

CAPTURE_SIZES = [1, 2, 4, 8]
CONTEXT = 64


def _trace() -> list[Request]:
    gen = torch.Generator().manual_seed(7)
    lengths = [1, 3, 5, 8, 13, 21, 34, 2, 9, 17, 4, 40, 6, 11]
    requests, step = [], 0
    for rid, n in enumerate(lengths):
        prompt = tuple(torch.randint(256, (n,), generator=gen).tolist())
        budget = int(torch.randint(4, 17, (), generator=gen))
        requests.append(Request(rid, prompt, budget, arrival_step=step))
        step += int(torch.randint(0, 3, (), generator=gen))
    return requests


TRACE = _trace()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[int]]]:
    """The checkpoint directory and transformers' greedy tokens per request."""
    path = tmp_path_factory.mktemp("oracle")
    return path, hf_greedy(save_tiny_llama(path), TRACE)


def _serve(path: Path, label: str, page_size: int) -> EngineResult:
    device = runner_device(label)
    kind, options = MECHANISMS[label]
    bundle = load_model(
        path,
        max_requests=max(CAPTURE_SIZES),
        max_context_len=CONTEXT,
        device=device,
        page_size=page_size,
    )
    assert bundle.kv_alloc.page_size == bundle.kv_cache.page_size == page_size
    # The sanitizer guards a real model's pools too: every replay is checked.
    runner = create_decode_runner(
        bundle, kind, capture_sizes=CAPTURE_SIZES, check_padding=True, **options
    )
    runner.capture()
    result = Engine(bundle, runner, check=True).run(TRACE)
    assert runner.sanitizer is not None
    assert runner.sanitizer.stats.replays_checked == runner.stats.replays == result.stats.steps
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size  # every page freed
    return result


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("kind", RUNNER_PARAMS)
def test_greedy_tokens_equal_transformers_generate(
    oracle: tuple[Path, dict[int, list[int]]], kind: str, page_size: int
) -> None:
    path, expected = oracle
    result = _serve(path, kind, page_size)
    assert result.finished == {r.rid for r in TRACE}
    for req in TRACE:
        assert result.outputs[req.rid] == expected[req.rid], (
            f"request {req.rid} ({kind}, page size {page_size})"
        )
    stats = result.stats
    assert stats.mismatches == 0 and stats.checked_steps == stats.steps
    # The trace must exercise padding: many batch sizes, most of them not captured.
    assert set(stats.batch_sizes) == set(range(1, 9)), stats.batch_sizes
    padded_steps = sum(n for bs, n in stats.batch_sizes.items() if bs not in CAPTURE_SIZES)
    assert padded_steps > stats.steps / 3 and stats.padded_rows > 0


@pytest.mark.parametrize("mode", ["overlap", "speculative"])
def test_overlap_and_speculative_equal_transformers_generate(
    oracle: tuple[Path, dict[int, list[int]]], mode: str
) -> None:
    """The oracle workload through the overlap engine and the speculative
    engine (EAGLE, a seeded random head): transformers' greedy tokens."""
    from graphrunner.core.future_map import FutureMap
    from graphrunner_ref.engine.spec_factory import speculative_engine

    path, expected = oracle
    bundle = load_model(path, max_requests=max(CAPTURE_SIZES), max_context_len=CONTEXT)
    if mode == "overlap":
        future = FutureMap(bundle.req_pool.req_to_token.shape[0], bundle.device)
        runner = create_decode_runner(
            bundle, "eager", capture_sizes=CAPTURE_SIZES, future_map=future, check_padding=True
        )
        runner.capture()
        outputs = Engine(bundle, runner, overlap=True).run(TRACE).outputs
    else:
        engine = speculative_engine(
            bundle, "eager", method="eagle", k=3, capture_sizes=CAPTURE_SIZES, check_padding=True
        )
        outputs = engine.run(TRACE).outputs
    assert outputs == expected
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("steps", [4, 8])
def test_several_steps_per_launch_equal_transformers_generate(
    oracle: tuple[Path, dict[int, list[int]]], steps: int, page_size: int
) -> None:
    """The oracle workload with N decode steps per launch (the sanitizer on):
    transformers' greedy tokens, one read back per launch, every page freed."""
    path, expected = oracle
    bundle = load_model(
        path, max_requests=max(CAPTURE_SIZES), max_context_len=CONTEXT, page_size=page_size
    )
    runner = create_decode_runner(
        bundle, "eager", capture_sizes=CAPTURE_SIZES, check_padding=True, steps_per_launch=steps
    )
    runner.capture()
    result = Engine(bundle, runner, steps_per_launch=steps).run(TRACE)
    assert result.outputs == expected
    assert result.stats.syncs == result.stats.launches == runner.stats.replays
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked > 0
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size
