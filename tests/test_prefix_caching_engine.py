"""Prefix caching through the engine: a request is admitted at its first
uncached token, its greedy tokens equal those of a run without the cache
(and the model alone, or transformers for the bridge), the cached tokens are
counted exactly, every schedule keeps working with it, a full pool evicts
cached pages before it refuses, the padding sanitizer passes a shared-prefix
run, and a Mamba model is refused by name."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.serving import build, open_engine
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import ModelBundle

SYSTEM = 24  # tokens of the shared prefix: 6 pages of 4, 24 of 1


def _shared_prefix_trace(
    n: int, *, seed: int = 0, gap: int = 0, new: int = 6, vocab: int = 256
) -> list[Request]:
    """``n`` prompts: one system prompt of :data:`SYSTEM` tokens, then a
    suffix of 3..9 tokens each; request ``i`` arrives at step ``i * gap``."""
    rng = random.Random(seed)
    system = [rng.randrange(1, vocab) for _ in range(SYSTEM)]
    return [
        Request(
            i,
            tuple(system + [rng.randrange(1, vocab) for _ in range(rng.randint(3, 9))]),
            new,
            arrival_step=i * gap,
        )
        for i in range(n)
    ]


def _bundle(page_size: int = 1, max_requests: int = 4, **options: Any) -> ModelBundle:
    config = EngineConfig(runner="eager", page_size=page_size, quiet=True, **options)
    built = build(config, max_requests=max_requests, context=96)
    assert isinstance(built, ModelBundle)
    return built


def _run(bundle: ModelBundle, trace: list[Request], caching: bool, **options: Any) -> EngineResult:
    config = EngineConfig(
        runner="eager", capture_sizes=(1, 2, 4), quiet=True, prefix_caching=caching, **options
    )
    return open_engine(config, bundle, trace=trace).run(trace)


@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_after_the_first_compute_only_their_suffix(page_size: int) -> None:
    bundle = _bundle(page_size)
    trace = _shared_prefix_trace(5, gap=20)  # each arrives after the last finished
    plain = _run(bundle, trace, caching=False)
    cached = _run(bundle, trace, caching=True)
    assert cached.outputs == plain.outputs
    assert cached.finished == plain.finished == {r.rid for r in trace}
    # Every later prompt finds the system prompt's pages, and no more (its suffix differs).
    assert cached.stats.cached_tokens == SYSTEM * (len(trace) - 1)
    prompt_tokens = sum(len(r.prompt) for r in trace)
    assert cached.stats.prefill_tokens == prompt_tokens - cached.stats.cached_tokens
    assert plain.stats.cached_tokens == 0 and plain.stats.prefill_tokens == prompt_tokens
    assert cached.stats.prefix_hit_rate == pytest.approx(SYSTEM * 4 / prompt_tokens)
    assert bundle.req_pool.available_size() == bundle.req_pool.size
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size  # cached pages evictable


def test_a_prompt_seen_whole_computes_only_its_last_token() -> None:
    bundle = _bundle(1)
    trace = _shared_prefix_trace(2, gap=20)
    again = [dataclasses.replace(r, rid=r.rid + 10, arrival_step=0) for r in trace[:1]]
    first = _run(bundle, trace, caching=True)
    second = _run(bundle, again, caching=True)
    assert second.outputs[10] == first.outputs[0]
    assert second.stats.cached_tokens == len(trace[0].prompt) - 1
    assert second.stats.prefill_tokens == 1


@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 8},
        {"chunked_prefill": False},
        {"overlap": True},
        {"steps_per_launch": 3},
        {"steps_per_launch": 2, "overlap": True},
        {"check": True},
    ],
    ids=["chunks-of-8", "whole-prompts", "overlap", "3-steps", "2-steps-overlap", "check"],
)
def test_every_schedule_gives_the_tokens_of_a_run_without_the_cache(
    options: dict[str, Any],
) -> None:
    bundle = _bundle(4)
    trace = _shared_prefix_trace(8, seed=1, gap=2)
    plain = _run(bundle, trace, caching=False, **options)
    cached = _run(bundle, trace, caching=True, **options)
    assert cached.outputs == plain.outputs
    assert cached.stats.cached_tokens > 0
    assert cached.stats.mismatches == 0
    assert bundle.req_pool.available_size() == bundle.req_pool.size


def test_a_full_pool_evicts_cached_pages_before_it_refuses() -> None:
    # 4 requests of up to 96 tokens fit; 24 distinct prompts leave far more
    # cached pages behind than the pool holds.
    bundle = _bundle(4)
    rng = random.Random(7)
    trace = [
        Request(i, tuple(rng.randrange(1, 256) for _ in range(rng.randint(30, 60))), 8)
        for i in range(24)
    ]
    plain = _run(bundle, trace, caching=False)
    cached = _run(bundle, trace, caching=True)
    assert cached.outputs == plain.outputs
    assert bundle.kv_alloc.stats.evictions > 0
    assert bundle.kv_alloc.inconsistencies() == []


def test_a_shared_prefix_run_passes_the_padding_sanitizer() -> None:
    bundle = _bundle(4)
    trace = _shared_prefix_trace(6, seed=2, gap=1)
    plain = _run(bundle, trace, caching=False)
    cached = _run(bundle, trace, caching=True, check_padding=True)
    assert cached.outputs == plain.outputs
    assert cached.stats.sanitized_replays > 0 and cached.stats.cached_tokens > 0


def test_a_mamba_model_is_refused_by_name() -> None:
    from fuzz_cases import MAMBA
    from graphrunner_ref.io.mamba_checkpoint import build_state_space_model

    bundle = build_state_space_model(MAMBA, max_requests=2, max_context_len=16)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2])
    with pytest.raises(ValueError, match="prefix_caching=True: .* carries state"):
        Engine(bundle, runner, prefix_caching=True)
    config = EngineConfig(runner="eager", capture_sizes=(1, 2), quiet=True)
    assert open_engine(config, bundle).prefix_cache is None  # on by default: off by itself


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_the_bridge_gives_transformers_tokens_with_the_cache(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    transformers = pytest.importorskip("transformers")
    from graphrunner_ref.bridge import load_transformers
    from hf_tiny import TINY_DECODER, hf_greedy, save_decoders

    configs = {
        "mistral": transformers.MistralConfig(**TINY_DECODER),
        "qwen2": transformers.Qwen2Config(**TINY_DECODER),
    }
    path, hf = save_decoders(tmp_path_factory, {arch: configs[arch]})[arch]
    vocab = configs[arch].vocab_size
    trace = _shared_prefix_trace(4, seed=3, gap=10, new=5, vocab=vocab)
    bundle = load_transformers(path, max_requests=2, max_context_len=64, page_size=4)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2])
    runner.capture()
    engine = Engine(bundle, runner, prefix_caching=True, max_num_batched_tokens=16)
    result = engine.run(trace)
    assert result.outputs == hf_greedy(hf, trace)
    assert result.stats.cached_tokens == SYSTEM * (len(trace) - 1)


def test_generate_prints_the_hit_rate_and_no_prefix_caching_turns_it_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _shared_prefix_trace(4)
    path = tmp_path / "prompts.txt"
    path.write_text("".join(json.dumps(list(r.prompt)) + "\n" for r in trace))
    argv = ["generate", "--prompts", str(path), "--json", "--runner", "eager", "-n", "4"]
    outputs = {}
    for flags in ([], ["--no-prefix-caching"]):
        assert cli.main([*argv, "--arrive-every", "8", *flags]) == 0
        out, err = capsys.readouterr()
        outputs[bool(flags)] = [json.loads(line)["token_ids"] for line in out.splitlines()]
        prompt = sum(len(r.prompt) for r in trace)
        cached = 0 if flags else SYSTEM * 3
        assert f"prefix cache hit rate {cached / prompt:.1%} ({cached}/{prompt})" in err
    assert outputs[True] == outputs[False]


def _pages_trace(shared_pages: int, *, together: bool, seed: int) -> list[Request]:
    """Six prompts of 4-token pages sharing their first ``shared_pages``
    pages, arriving at once or one after another."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 256) for _ in range(4 * shared_pages)]
    return [
        Request(
            i,
            tuple(prefix + [rng.randrange(1, 256) for _ in range(rng.randint(1, 9))]),
            5,
            arrival_step=0 if together else i * 12,
        )
        for i in range(6)
    ]


@pytest.mark.parametrize("together", [True, False], ids=["together", "one-after-another"])
@pytest.mark.parametrize("shared_pages", [0, 1, 3])
def test_requests_sharing_0_1_or_several_pages_get_the_uncached_tokens(
    shared_pages: int, together: bool
) -> None:
    bundle = _bundle(4)
    trace = _pages_trace(shared_pages, together=together, seed=shared_pages)
    plain = _run(bundle, trace, caching=False)
    cached = _run(bundle, trace, caching=True)
    assert cached.outputs == plain.outputs
    if not together:  # each finds its predecessors' shared pages whole
        assert cached.stats.cached_tokens == 4 * shared_pages * (len(trace) - 1)


@pytest.mark.parametrize("budget", [3, 4, 5, 7, 8, 9])
def test_chunks_cut_at_every_offset_around_a_page_boundary_keep_the_tokens(budget: int) -> None:
    # Two cached pages (8 tokens): the uncached part starts on a page
    # boundary, and budgets of 3..9 cut it just before, on and after the next.
    bundle = _bundle(4)
    trace = _pages_trace(2, together=False, seed=budget)
    plain = _run(bundle, trace, caching=False, max_num_batched_tokens=budget)
    cached = _run(bundle, trace, caching=True, max_num_batched_tokens=budget)
    assert cached.outputs == plain.outputs
    assert cached.stats.cached_tokens == 8 * (len(trace) - 1)


def test_a_seeded_sampled_request_draws_the_same_tokens_cached_or_not() -> None:
    from graphrunner.sampling import SamplingParams

    bundle = _bundle(4)
    trace = [
        dataclasses.replace(r, sampling=SamplingParams(temperature=0.9, top_k=40, seed=7 + r.rid))
        for r in _shared_prefix_trace(5, seed=4, gap=3)
    ]
    plain = _run(bundle, trace, caching=False)
    cached = _run(bundle, trace, caching=True)
    assert cached.outputs == plain.outputs
    assert cached.stats.cached_tokens > 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("budget", [None, 8])
def test_requests_arriving_together_compute_a_shared_prefix_once(
    page_size: int, budget: int | None
) -> None:
    """Four requests over one system prompt, all at step 0 (as a load
    generator's first burst): the first prefills the system prompt, the others
    wait for it and find its pages, whole prompts or chunks of 8 (indexed as
    they are written), and their tokens equal a run without the cache."""
    bundle = _bundle(page_size)
    trace = _shared_prefix_trace(4, seed=3)  # gap 0: every request arrives at once
    options: dict[str, Any] = (
        {"chunked_prefill": False} if budget is None else {"max_num_batched_tokens": budget}
    )
    plain = _run(bundle, trace, caching=False, **options)
    cached = _run(bundle, trace, caching=True, **options)
    assert cached.outputs == plain.outputs
    assert cached.stats.cached_tokens == SYSTEM * (len(trace) - 1)
    prompt_tokens = sum(len(r.prompt) for r in trace)
    assert cached.stats.prefill_tokens == prompt_tokens - SYSTEM * (len(trace) - 1)


def test_a_request_waiting_for_a_shared_prefill_holds_no_other_back_forever() -> None:
    """The wait ends: requests behind a waiting one, sharing nothing, finish too."""
    bundle = _bundle(1)
    shared = _shared_prefix_trace(3, seed=4)
    other = Request(3, tuple(range(200, 240)), 6)
    trace = [*shared, other]
    cached = _run(bundle, trace, caching=True, max_num_batched_tokens=8)
    plain = _run(bundle, trace, caching=False, max_num_batched_tokens=8)
    assert cached.finished == {r.rid for r in trace}
    assert cached.outputs == plain.outputs
