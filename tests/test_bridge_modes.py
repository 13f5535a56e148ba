"""Everything the bridge runs also runs in every serving mode, as a user runs
it: ``generate --model DIR --model-impl transformers`` with ``--quantize``,
``--temperature`` / ``--seed``, ``--overlap``, ``--steps-per-launch`` and a
chunked prefill, on a dense decoder and a mixture-of-experts one. Greedy
modes give transformers' tokens (``--quantize fp16``: the same tokens as the
float32 run is not promised, so it must run and answer every prompt);
seeded sampling gives a request the same tokens alone and in a batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner_ref.engine.workload import Request
from hf_tiny import hf_greedy, save_decoders, tiny_config

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6, 2, 9, 10, 3]]
NEW = 6
COMMON = ["--model-impl", "transformers", "--runner", "eager", "--capture-sizes", "1,2,4"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    configs = {
        "qwen2": tiny_config("qwen2"),
        "mixtral": tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2),
    }
    return save_decoders(tmp_path_factory, configs)


@pytest.fixture(params=["qwen2", "mixtral"])
def decoder(request: pytest.FixtureRequest, saved: dict[str, tuple[Path, Any]]) -> tuple[Path, Any]:
    """A dense and a mixture-of-experts decoder: the checkpoint and transformers' model."""
    return saved[request.param]


def _generate(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path, prompts: Any, *extra: str
) -> list[list[int]]:
    file = tmp_path / "prompts.jsonl"
    file.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    argv = ["generate", "--model", str(model), "--prompts", str(file), "--max-new-tokens", str(NEW)]
    assert cli.main([*argv, "--json", *COMMON, *extra]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [r["token_ids"] for r in sorted(records, key=lambda r: r["index"])]


@pytest.mark.parametrize(
    "mode",
    [
        [],
        ["--overlap"],
        ["--steps-per-launch", "3"],
        ["--max-num-batched-tokens", "3"],
        ["--check-padding"],
    ],
    ids=["plain", "overlap", "multistep", "chunked", "sanitized"],
)
def test_a_greedy_mode_gives_transformers_tokens(
    mode: list[str],
    decoder: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, reference = decoder
    requests = [Request(i, tuple(p), NEW) for i, p in enumerate(PROMPTS)]
    expected = hf_greedy(reference, requests)
    got = _generate(capsys, tmp_path, path, PROMPTS, "--ignore-eos", *mode)
    assert got == [expected[i] for i in range(len(PROMPTS))]


def test_quantized_weights_answer_every_prompt(
    decoder: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = decoder
    got = _generate(capsys, tmp_path, path, PROMPTS, "--ignore-eos", "--quantize", "fp16")
    assert [len(t) for t in got] == [NEW] * len(PROMPTS)


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch(
    decoder: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, _ = decoder
    lines = [{"prompt": p, "temperature": 0.9, "seed": 100 + i} for i, p in enumerate(PROMPTS)]
    together = _generate(capsys, tmp_path, path, lines, "--ignore-eos")
    alone = _generate(capsys, tmp_path, path, lines[2:], "--ignore-eos")
    assert alone[0] == together[2]
    greedy = _generate(capsys, tmp_path, path, PROMPTS[2:], "--ignore-eos")
    assert alone[0] != greedy[0]  # it did sample
