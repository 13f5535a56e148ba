"""``--speculative`` and ``--overlap`` on the CLI:
the same greedy tokens as plain decoding, and named errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner_ref.engine import serving
from test_cli import EAGER, PROMPTS, _expected


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.mark.parametrize(
    ("method", "draft", "k"), [("mtp", "random", 2), ("eagle", "random", 3), ("eagle", "self", 2)]
)
def test_generate_speculative_prints_the_plain_greedy_tokens(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], method: str, draft: str, k: int
) -> None:
    argv = ["generate", "--prompts", str(prompts_file), "--max-new-tokens", "6", *EAGER]
    argv += ["--speculative", method, "--draft", draft, "--draft-tokens", str(k), "--check"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    tokens = [json.loads(line)["token_ids"] for line in captured.out.splitlines()]
    assert tokens == _expected(6)
    assert "mismatches: 0" in captured.err


def test_demo_speculative_reports_acceptance_and_matches_plain_greedy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["demo", "--steps", "12", *EAGER, "--speculative", "mtp", "--draft", "self"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "speculative: mtp (self draft), K=2" in out
    assert "acceptance: 100.0%" in out
    assert "mismatches: 0" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft-tokens", "0"], "--draft-tokens 0: expected 1..16"),
        (["--draft-tokens", "17"], "--draft-tokens 17: expected 1..16"),
        (["--page-size", "4"], "--page-size 4 with --speculative: expected 1"),
    ],
)
def test_bad_speculative_options_exit_2_before_any_work(
    prompts_file: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    argv = ["generate", "--prompts", str(prompts_file), *EAGER, "--speculative", "mtp", *extra]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_draft_tokens_that_overflow_the_context_are_named(
    prompts_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    argv = ["generate", "--prompts", str(prompts_file), *EAGER, "--max-new-tokens", "245"]
    argv += ["--speculative", "mtp", "--draft-tokens", "8"]
    assert cli.main(argv) == 2
    assert "--draft-tokens 8: the prompts need a context of" in capsys.readouterr().err


def test_generate_overlap_prints_the_plain_greedy_tokens(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--prompts", str(prompts_file), "--max-new-tokens", "6", *EAGER]
    assert cli.main([*argv, "--overlap", "--check", "--arrive-every", "1"]) == 0
    captured = capsys.readouterr()
    assert [json.loads(line)["token_ids"] for line in captured.out.splitlines()] == _expected(6)
    assert "mismatches: 0" in captured.err


def test_demo_overlap_matches_plain_greedy(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "20", *EAGER, "--overlap"]) == 0
    out = capsys.readouterr().out
    assert "overlap: 20 steps" in out and "mismatches: 0" in out


def test_overlap_and_speculative_are_not_combined(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--prompts", str(prompts_file), *EAGER, "--overlap", "--speculative", "mtp"]
    assert cli.main(argv) == 2
    assert "--overlap with --speculative" in capsys.readouterr().err
