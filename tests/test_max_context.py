"""``--max-context-len N`` on demo and generate: request rows and the KV pool
sized for N whatever the checkpoint declares; a prompt plus its new tokens
past N refused before any work, naming the prompt."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner_ref.engine import serving
from graphrunner_ref.model import ModelBundle
from hf_tiny import save_tiny_llama


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[ModelBundle]:
    """Every bundle the CLI builds, in order."""
    bundles: list[ModelBundle] = []
    build = serving.build

    def spy(*args: Any) -> ModelBundle:
        bundles.append(build(*args))
        return bundles[-1]

    monkeypatch.setattr(serving, "build", spy)
    return bundles


@pytest.fixture
def long_context_checkpoint(tmp_path: Path) -> Path:
    """The tiny Llama with a config declaring 8192 positions (as SmolLM2 does)."""
    path = tmp_path / "ck"
    save_tiny_llama(path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(config))
    return path


def _prompts(tmp_path: Path, prompts: list[list[int]]) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return path


def _tokens(out: str) -> list[list[int]]:
    return [json.loads(line)["token_ids"] for line in out.splitlines()]


def test_generate_sizes_rows_and_kv_pool_for_n_whatever_the_checkpoint_declares(
    long_context_checkpoint: Path,
    tmp_path: Path,
    built: list[ModelBundle],
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = _prompts(tmp_path, [[1, 2, 3], [9, 8, 7, 6, 5]])
    base = ["generate", "--prompts", str(prompts), "--checkpoint", str(long_context_checkpoint)]
    base += ["--runner", "eager", "--max-new-tokens", "6"]
    assert cli.main([*base, "--max-context-len", "48"]) == 0
    bounded = _tokens(capsys.readouterr().out)
    bundle = built[-1]
    assert bundle.config.max_position_embeddings == 8192
    assert bundle.max_context_len == 48
    assert bundle.req_pool.req_to_token.shape == (2 + 1, 48)  # one row per request, + padding
    assert bundle.kv_alloc.size == 2 * 48
    # The bound changes the sizes, not the tokens.
    assert cli.main(base) == 0
    assert _tokens(capsys.readouterr().out) == bounded
    assert built[-1].max_context_len == 5 + 6 - 1  # without it: what the prompts need


def test_demo_runs_at_the_bounded_context(
    built: list[ModelBundle], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--runner", "eager", "--steps", "12", "--max-context-len", "24"]
    assert cli.main([*argv, "--capture-sizes", "1,2,4"]) == 0
    assert built[-1].max_context_len == 24
    out = capsys.readouterr().out
    assert "context 24" in out and "mismatches: 0" in out


@pytest.mark.parametrize(
    "prompts, extra, message",
    [
        (
            [[1, 2], [1] * 9],
            [],
            "{dir}/p.jsonl:2: prompt of 9 tokens + 8 new tokens needs a context of 16, "
            "longer than --max-context-len 12",
        ),
        (
            [[1, 2]],
            ["--max-new-tokens", "13"],
            "--max-new-tokens 13: expected 1..12 (--max-context-len)",
        ),
    ],
)
def test_a_prompt_past_n_is_refused_before_any_work_naming_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    prompts: list[list[int]],
    extra: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    argv = ["generate", "--prompts", str(_prompts(tmp_path, prompts)), "--runner", "eager"]
    argv += ["--max-new-tokens", "8", "--max-context-len", "12", *extra]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    message = message.replace("{dir}", str(tmp_path))
    assert captured.err == f"graphrunner generate: error: {message}\n"


@pytest.mark.parametrize("value", ["0", "257", "-1"])
@pytest.mark.parametrize("command", ["demo", "generate"])
def test_max_context_len_out_of_range_exits_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    value: str,
    command: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    argv = [command, "--runner", "eager", "--max-context-len", value]
    if command == "generate":
        argv += ["--prompts", str(_prompts(tmp_path, [[1]]))]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"graphrunner {command}: error: --max-context-len {value}: expected 1..256 "
        "(the model's context)\n"
    )
