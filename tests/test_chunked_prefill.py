"""Chunked prefill: with a per-step token budget (``max_num_batched_tokens``)
the running requests' decode tokens go first and prompts are prefilled in
chunks over several steps, each chunk attending to the KV its earlier chunks
wrote. The answers are transformers' greedy ``generate`` of each prompt alone,
the same as the unchunked engine's, through padded replay under the padding
sanitizer; a Mamba model is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import MECHANISMS, runner_device
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_model
from hf_tiny import hf_greedy, save_decoders, save_tiny_llama, tiny_config

transformers = pytest.importorskip("transformers")

CAPTURE_SIZES = [1, 2, 4]
CONTEXT = 64


def _trace() -> list[Request]:
    """Short prompts decoding while longer ones arrive: a 40-token prompt is
    5 chunks of 8, or 20 of 2 (fewer tokens when requests are running)."""
    gen = torch.Generator().manual_seed(11)
    lengths = [3, 5, 40, 2, 17, 9, 33, 1]
    requests, step = [], 0
    for rid, n in enumerate(lengths):
        prompt = tuple(torch.randint(128, (n,), generator=gen).tolist())  # the tiny vocab
        requests.append(Request(rid, prompt, 6 + rid % 4, arrival_step=step))
        step += 1 + rid % 2
    return requests


TRACE = _trace()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[int]]]:
    path = tmp_path_factory.mktemp("chunked")
    return path, hf_greedy(save_tiny_llama(path), TRACE)


def _serve(bundle: Any, label: str, budget: int | None) -> EngineResult:
    kind, options = MECHANISMS[label]
    runner = create_decode_runner(
        bundle, kind, capture_sizes=CAPTURE_SIZES, check_padding=True, **options
    )
    runner.capture()
    engine = Engine(bundle, runner, max_num_batched_tokens=budget)
    result = engine.run(TRACE)
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size  # every page freed
    assert bundle.req_pool.available_size() == bundle.req_pool.size
    return result


@pytest.mark.parametrize("budget", [None, 2, 8, 40])
def test_chunked_prefill_gives_transformers_tokens(
    oracle: tuple[Path, dict[int, list[int]]], budget: int | None
) -> None:
    path, expected = oracle
    bundle = load_model(path, max_requests=4, max_context_len=CONTEXT, page_size=4)
    result = _serve(bundle, "eager", budget)
    assert result.outputs == expected
    stats = result.stats
    assert stats.prefills == len(TRACE)
    assert stats.prefill_tokens == sum(len(r.prompt) for r in TRACE)
    if budget is None or budget >= 40:
        assert stats.prefill_chunks <= len(TRACE) + 1  # one chunk per prompt or so
    else:  # the 40-token prompt alone takes 40 / budget chunks at least
        assert stats.prefill_chunks >= len(TRACE) - 1 + 40 // budget


@pytest.mark.parametrize("label", ["cpu"])
def test_chunked_prefill_through_the_compiled_runner(
    oracle: tuple[Path, dict[int, list[int]]], label: str
) -> None:
    path, expected = oracle
    device = runner_device(label)
    bundle = load_model(path, max_requests=4, max_context_len=CONTEXT, device=device, page_size=4)
    assert _serve(bundle, label, 5).outputs == expected


def test_running_requests_decode_every_step_while_a_long_prompt_prefills(
    oracle: tuple[Path, dict[int, list[int]]],
) -> None:
    """Two requests decode; a 40-token prompt arrives. With a budget of 6
    tokens, 2 decode rows leave 4 prompt tokens a step: the running requests
    get a token in each of the prompt's 10 prefill steps."""
    path, _ = oracle
    gen = torch.Generator().manual_seed(3)
    short = [Request(rid, (5, 6, 7), 30, arrival_step=0) for rid in (0, 1)]
    long = Request(2, tuple(torch.randint(256, (40,), generator=gen).tolist()), 2, arrival_step=2)
    bundle = load_model(path, max_requests=4, max_context_len=CONTEXT, page_size=4)
    runner = create_decode_runner(bundle, "eager", capture_sizes=CAPTURE_SIZES)
    runner.capture()
    steps: dict[int, list[int]] = {0: [], 1: [], 2: []}
    clock = [0]

    def on_token(rid: int, token: int) -> None:
        steps[rid].append(clock[0])

    engine = Engine(bundle, runner, on_token=on_token, max_num_batched_tokens=6)
    original = engine.schedule.run

    def counted(run: Any, plan: Any) -> Any:
        clock[0] = run.clock
        return original(run, plan)

    engine.schedule.run = counted  # type: ignore[method-assign]
    result = engine.run([*short, long])
    first_long = steps[2][0]
    assert first_long - long.arrival_step >= 9  # 40 tokens, 4 a step
    during = range(long.arrival_step, first_long)
    for rid in (0, 1):  # a token in every step of the long prefill
        assert set(during) <= set(steps[rid]), (rid, steps[rid], during)
    assert result.stats.prefill_chunks >= 10


def test_the_bridge_prefills_in_chunks_on_two_architectures(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from graphrunner_ref.bridge import load_transformers

    configs = {"qwen2": tiny_config("qwen2"), "gemma": tiny_config("gemma")}
    for name, (path, reference) in save_decoders(tmp_path_factory, configs).items():
        expected = hf_greedy(reference, TRACE)
        bundle = load_transformers(path, max_requests=4, max_context_len=CONTEXT)
        assert _serve(bundle, "eager", 7).outputs == expected, name


@pytest.mark.parametrize("budget", [0, -3, True, 2.5])
def test_a_bad_budget_is_refused_by_name(
    oracle: tuple[Path, dict[int, list[int]]], budget: Any
) -> None:
    path, _ = oracle
    bundle = load_model(path, max_requests=2, max_context_len=CONTEXT)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2])
    with pytest.raises(ValueError, match=f"max_num_batched_tokens={budget!r}; expected an int"):
        Engine(bundle, runner, max_num_batched_tokens=budget)


def test_a_mamba_model_is_refused_with_a_budget() -> None:
    from fuzz_cases import MAMBA
    from graphrunner_ref.io.mamba_checkpoint import build_state_space_model

    bundle = build_state_space_model(MAMBA, max_requests=2, max_context_len=16)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2])
    with pytest.raises(ValueError, match="chunked prefill needs a model whose prefill extends"):
        Engine(bundle, runner, max_num_batched_tokens=8)
    Engine(bundle, runner)  # unchunked: as before


def test_generate_with_a_budget_a_quarter_of_the_prompt_gives_transformers_tokens(
    oracle: tuple[Path, dict[int, list[int]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``generate --max-num-batched-tokens N`` on a prompt of 4N tokens, as a
    user runs it: the answer is transformers' greedy one."""
    import json

    import graphrunner_ref.cli.main as cli

    path, _ = oracle
    prompt = TRACE[2].prompt  # 40 tokens: N = 10
    (tmp_path / "p.jsonl").write_text(json.dumps(list(prompt)) + "\n")
    request = Request(0, prompt, 8)
    from transformers import AutoModelForCausalLM

    expected = hf_greedy(AutoModelForCausalLM.from_pretrained(path), [request])[0]
    argv = ["generate", "--checkpoint", str(path), "--prompts", str(tmp_path / "p.jsonl")]
    argv += ["--max-new-tokens", "8", "--json", "--runner", "eager", "--capture-sizes", "1,2"]
    argv += ["--max-num-batched-tokens", "10", "--max-context-len", str(CONTEXT)]
    assert cli.main(argv) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["token_ids"] == expected


def test_the_budget_and_no_chunked_prefill_are_refused_together(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import graphrunner_ref.cli.main as cli

    argv = ["generate", "--prompt", "[1, 2]", "--max-num-batched-tokens", "8"]
    assert cli.main([*argv, "--no-chunked-prefill"]) == 2
    assert "with --no-chunked-prefill: expected one of them" in capsys.readouterr().err
    assert cli.main(["generate", "--max-num-batched-tokens", "0"]) == 2
    assert "--max-num-batched-tokens 0: expected 1..1048576" in capsys.readouterr().err


def test_the_flags_set_the_engines_budget(oracle: tuple[Path, dict[int, list[int]]]) -> None:
    import graphrunner_ref.cli.main as cli
    from fuzz_cases import MAMBA
    from graphrunner_ref.cli.options import config_of
    from graphrunner_ref.engine.config import DEFAULT_BATCHED_TOKENS
    from graphrunner_ref.engine.serving import token_budget
    from graphrunner_ref.io.mamba_checkpoint import build_state_space_model

    path, _ = oracle
    llama = load_model(path, max_requests=2, max_context_len=CONTEXT)
    mamba = build_state_space_model(MAMBA, max_requests=2, max_context_len=16)

    def budget(extra: list[str], bundle: Any) -> int | None:
        args = cli._parse(["generate", "--prompt", "[1, 2]", *extra])
        return token_budget(config_of(args, "eager", [1, 2]), bundle)

    assert budget([], llama) == DEFAULT_BATCHED_TOKENS
    assert budget(["--max-num-batched-tokens", "16"], llama) == 16
    assert budget(["--no-chunked-prefill"], llama) is None
    assert budget([], mamba) is None  # prefilled whole, as before
    assert budget(["--max-num-batched-tokens", "16"], mamba) == 16  # the engine refuses it
