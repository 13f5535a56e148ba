"""``--model-impl``: a checkpoint the native model does not run goes through
the transformers bridge (``auto``), equal to transformers' greedy tokens; the
choice can be forced either way, and the native model's options are refused
with the bridge by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from graphrunner_ref.cli import main as cli
from graphrunner_ref.engine.workload import Request
from hf_tiny import TINY_DECODER, hf_greedy, save_tiny_llama

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 5, 9], [11, 2], [40, 41, 42]]
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    config = transformers.Qwen2Config(**TINY_DECODER)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return path, model


def _expected(model: Any) -> list[list[int]]:
    trace = [Request(i, tuple(p), NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    tokens = hf_greedy(model, trace)
    return [tokens[i] for i in range(len(PROMPTS))]


def _generate(model: Path, tmp_path: Path, *extra: str) -> tuple[int, list[list[int]]]:
    prompts, out = tmp_path / "prompts.ids", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    rc = cli.main(
        [
            "generate", "--model", str(model), "--prompts", str(prompts), "--prompts-format",
            "ids", "--max-new-tokens", str(NEW_TOKENS), "--runner", "eager",
            "--capture-sizes", "1,2,4", "--check-padding", "--check", "--output", str(out),
            *extra,
        ]
    )  # fmt: skip
    lines = out.read_text().splitlines() if out.exists() else []
    return rc, [json.loads(line)["token_ids"] for line in lines]


def test_auto_runs_an_unsupported_architecture_through_the_bridge(
    qwen2: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, model = qwen2
    rc, tokens = _generate(path, tmp_path)
    assert rc == 0
    assert tokens == _expected(model)
    assert "--model-impl transformers" in capsys.readouterr().err


def test_native_refuses_it_naming_the_bridge(
    qwen2: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _ = _generate(qwen2[0], tmp_path, "--model-impl", "native")
    err = capsys.readouterr().err
    assert rc == 2
    assert "Qwen2ForCausalLM" in err and "LlamaForCausalLM" in err
    assert "--model-impl transformers" in err


def test_the_bridge_runs_a_llama_the_native_model_runs_too(tmp_path: Path) -> None:
    path = tmp_path / "llama"
    model = save_tiny_llama(path)
    rc_bridge, bridge = _generate(path, tmp_path, "--model-impl", "transformers")
    rc_native, native = _generate(path, tmp_path, "--model-impl", "native")
    assert rc_bridge == rc_native == 0
    assert bridge == native == _expected(model)


@pytest.mark.parametrize(("extra", "named"), [(["--attention", "torch"], "--attention")])
def test_the_native_models_options_are_refused_with_the_bridge(
    qwen2: tuple[Path, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    named: str,
) -> None:
    rc, _ = _generate(qwen2[0], tmp_path, "--model-impl", "transformers", *extra)
    assert rc == 2
    assert named in capsys.readouterr().err


def test_the_embedded_model_is_native_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--model-impl", "transformers", "--steps", "1"]) == 2
    assert "needs a checkpoint" in capsys.readouterr().err


def test_demo_checks_the_bridge_against_its_eager_forward(
    qwen2: tuple[Path, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--model", str(qwen2[0]), "--runner", "eager", "--steps", "6", "--max-bs", "4"]
    assert cli.main(argv) == 0
    assert "mismatches: 0" in capsys.readouterr().out
