"""Chunked prefill through the captured token-batch step: each engine step's
prompt chunks (of one prompt or several) run as one token batch, padded on
tokens and requests, under the padding sanitizer; the answers are
transformers' greedy ``generate`` of each prompt alone, as the unchunked
engine's are. A step above the largest token size runs eagerly, counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import MECHANISMS, runner_device
from graphrunner_ref.engine.bundle import create_token_runner
from graphrunner_ref.engine.loop import Engine, EngineResult, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_model
from hf_tiny import hf_greedy, save_tiny_llama

transformers = pytest.importorskip("transformers")

CONTEXT = 64
#: Token sizes: a step of up to 8 prompt tokens is padded to 4 or 8; the
#: budget of 9 makes some steps one token above the largest (eager, counted).
TOKEN_SIZES = [4, 8]
BUDGET = 9


@pytest.fixture(autouse=True)
def _token_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine runs capture their token runner here (the suite turns it off elsewhere)."""
    monkeypatch.setenv("GRAPHRUNNER_TOKEN_BATCHES", "1")


def _trace() -> list[Request]:
    """Prompts of 1 to 33 tokens, arriving while others decode: with 9
    tokens a step, a prompt is prefilled in 1 to 5 chunks, and a step's
    chunks often belong to two prompts."""
    gen = torch.Generator().manual_seed(7)
    lengths = [3, 12, 33, 1, 17, 9, 26, 5, 2, 30]
    requests, step = [], 0
    for rid, n in enumerate(lengths):
        prompt = tuple(torch.randint(128, (n,), generator=gen).tolist())
        requests.append(Request(rid, prompt, 5 + rid % 3, arrival_step=step))
        step += rid % 2
    return requests


TRACE = _trace()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[int]]]:
    path = tmp_path_factory.mktemp("token-batch")
    return path, hf_greedy(save_tiny_llama(path), TRACE)


def _serve(path: Path, label: str) -> tuple[EngineResult, Any]:
    kind, options = MECHANISMS[label]
    bundle = load_model(
        path, max_requests=4, max_context_len=CONTEXT, device=runner_device(label), page_size=4
    )
    decode = create_decode_runner(bundle, kind, capture_sizes=[1, 2, 4], **options)
    decode.capture()
    tokens = create_token_runner(
        bundle, kind, BUDGET, capture_sizes=TOKEN_SIZES, check_padding=True, **options
    )
    tokens.capture()
    engine = Engine(bundle, decode, max_num_batched_tokens=BUDGET, token_runner=tokens)
    result = engine.run(TRACE)
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size  # every page freed
    assert bundle.req_pool.available_size() == bundle.req_pool.size
    return result, tokens


@pytest.mark.parametrize("label", ["eager", "cpu"])
def test_prompt_chunks_through_the_token_runner_give_transformers_tokens(
    oracle: tuple[Path, dict[int, list[int]]], label: str
) -> None:
    path, expected = oracle
    result, tokens = _serve(path, label)
    assert result.outputs == expected
    stats = result.stats
    assert stats.prefills == len(TRACE)
    assert stats.prefill_tokens == sum(len(r.prompt) for r in TRACE)
    assert stats.prefill_chunks >= len(TRACE) + 33 // BUDGET  # the long prompts split
    served = tokens.batch_sizes.counts()  # the steps' live token counts
    assert max(served) == BUDGET  # one above the largest size: eager, counted
    assert tokens.stats.eager_fallbacks == served[BUDGET]
    assert tokens.stats.replays == sum(n for size, n in served.items() if size <= 8)
    assert tokens.stats.padded_rows > 0  # padded replays, checked by the sanitizer
    assert tokens.sanitizer is not None and tokens.sanitizer.stats.replays_checked > 0


def test_generate_runs_prompt_chunks_through_the_token_runner(
    oracle: tuple[Path, dict[int, list[int]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``generate --max-num-batched-tokens N --token-capture-sizes ...`` on a
    prompt of 4N tokens gives transformers' greedy answer, its chunks run
    as token batches (their token counts written by ``--token-sizes-out``)."""
    import graphrunner_ref.cli.main as cli
    from graphrunner.sizing import read_histogram

    path, expected = oracle
    request = TRACE[2]  # 33 tokens: N = 8 is 5 chunks
    (tmp_path / "p.jsonl").write_text(json.dumps(list(request.prompt)) + "\n")
    argv = ["generate", "--checkpoint", str(path), "--prompts", str(tmp_path / "p.jsonl")]
    argv += ["--max-new-tokens", str(request.max_new_tokens), "--json", "--runner", "eager"]
    argv += ["--capture-sizes", "1,2", "--max-num-batched-tokens", "8"]
    argv += ["--token-capture-sizes", "4,8", "--max-context-len", str(CONTEXT)]
    argv += ["--token-sizes-out", str(tmp_path / "tokens.json")]
    assert cli.main(argv) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["token_ids"] == expected[2]
    assert read_histogram(tmp_path / "tokens.json").counts() == {1: 1, 8: 4}  # 8+8+8+8+1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--token-capture-sizes", "4,x"], "expected comma-separated ints"),
        (["--token-capture-sizes", "0,8"], "expected sizes in 1..1048576"),
        (
            ["--max-num-batched-tokens", "16", "--token-capture-sizes", "4,8"],
            "expected the largest to cover --max-num-batched-tokens 16",
        ),
        (["--no-chunked-prefill", "--token-capture-sizes", "4"], "with --no-chunked-prefill"),
    ],
)
def test_bad_token_sizes_are_refused_by_flag(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import graphrunner_ref.cli.main as cli

    assert cli.main(["generate", "--prompt", "[1, 2]", *extra]) == 2
    err = capsys.readouterr().err
    assert "--token-capture-sizes" in err and message in err


def test_the_sizes_tool_chooses_token_sizes_from_a_run(
    oracle: tuple[Path, dict[int, list[int]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``generate --token-sizes-out`` writes the prefill steps' token counts;
    ``graphrunner sizes --tokens`` chooses token sizes from them."""
    import graphrunner_ref.cli.main as cli
    from graphrunner.sizing import read_histogram

    path, _ = oracle
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(list(r.prompt)) + "\n" for r in TRACE[:4]))
    counts = tmp_path / "tokens.json"
    argv = ["generate", "--checkpoint", str(path), "--prompts", str(prompts), "--json"]
    argv += ["--max-new-tokens", "3", "--runner", "eager", "--capture-sizes", "1,2,4"]
    argv += ["--max-num-batched-tokens", "8", "--max-context-len", str(CONTEXT)]
    assert cli.main([*argv, "--token-sizes-out", str(counts)]) == 0
    served = read_histogram(counts).counts()
    assert max(served) <= 8 and sum(n * c for n, c in served.items()) == sum(
        len(r.prompt) for r in TRACE[:4]
    )
    capsys.readouterr()
    assert cli.main(["sizes", "--trace", str(counts), "--graphs", "2", "--tokens"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("--token-capture-sizes ") and last.endswith(str(max(served)))
    unchunked = [a for a in argv if a not in ("--max-num-batched-tokens", "8")]
    refused = [*unchunked, "--no-chunked-prefill", "--token-sizes-out", str(tmp_path / "x")]
    assert cli.main(refused) == 2
    assert "not with --no-chunked-prefill" in capsys.readouterr().err


def test_the_bridge_runs_prompt_chunks_as_token_batches_on_two_architectures(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The transformers bridge's token step (each token a row of its own
    request) through the eager token runner, sanitized: transformers' tokens."""
    from graphrunner_ref.bridge import load_transformers
    from hf_tiny import save_decoders, tiny_config

    configs = {"qwen2": tiny_config("qwen2"), "gemma": tiny_config("gemma")}
    for name, (path, reference) in save_decoders(tmp_path_factory, configs).items():
        expected = hf_greedy(reference, TRACE)
        bundle = load_transformers(path, max_requests=4, max_context_len=CONTEXT)
        decode = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4])
        decode.capture()
        tokens = create_token_runner(
            bundle, "eager", BUDGET, capture_sizes=TOKEN_SIZES, check_padding=True
        )
        tokens.capture()
        engine = Engine(bundle, decode, max_num_batched_tokens=BUDGET, token_runner=tokens)
        assert engine.run(TRACE).outputs == expected, name
        assert tokens.stats.replays > 0 and tokens.sanitizer is not None
        checked = tokens.stats.replays + tokens.stats.eager_fallbacks  # eager steps too
        assert tokens.sanitizer.stats.replays_checked == checked
