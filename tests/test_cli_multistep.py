"""``--steps-per-launch N`` on the command line: ``generate`` prints the
tokens of N = 1 (greedy, sampled, paged, with an end token), the demo checks
N against N = 1 and exits 0, and every combination N > 1 does not take is
refused by name before any work."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import graphrunner_ref.cli.main as cli
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.multistep_overlap import MultiStepOverlapSchedule

PROMPTS = [[1, 2, 3], [200], [7, 7, 7, 7, 7, 7, 7, 7], [0, 255, 9, 4], [5, 6]]
EAGER = ["--runner", "eager", "--capture-sizes", "1,2,4", "--max-new-tokens", "9"]


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _tokens(capsys: pytest.CaptureFixture[str], prompts: Path, *argv: str) -> list[list[int]]:
    assert cli.main(["generate", "--prompts", str(prompts), "--json", *EAGER, *argv]) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--temperature", "0.9", "--top-k", "20", "--seed", "5"],
        ["--page-size", "4", "--check-padding"],
        ["--end-token", "17", "--arrive-every", "2"],
    ],
    ids=["greedy", "sampled", "paged", "end-token"],
)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_generate_prints_the_tokens_of_one_step_per_launch(
    capsys: pytest.CaptureFixture[str], prompts_file: Path, n: int, extra: list[str]
) -> None:
    single = _tokens(capsys, prompts_file, *extra)
    assert _tokens(capsys, prompts_file, "--steps-per-launch", str(n), *extra) == single
    assert len(single) == len(PROMPTS)


def _records(capsys: pytest.CaptureFixture[str], prompts: Path, *argv: str) -> list[dict]:
    assert cli.main(["generate", "--prompts", str(prompts), "--json", *EAGER, *argv]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "extra",
    [[], ["--temperature", "0.9", "--seed", "5", "--end-token", "17"]],
    ids=["greedy", "sampled"],
)
def test_generate_logprobs_equal_those_of_one_step_per_launch(
    capsys: pytest.CaptureFixture[str], prompts_file: Path, n: int, extra: list[str]
) -> None:
    argv = ["--logprobs", "3", "--capture-sizes", "4", *extra]
    single = _records(capsys, prompts_file, *argv)
    multi = _records(capsys, prompts_file, "--steps-per-launch", str(n), *argv)
    assert [r["logprobs"] for r in multi] == [r["logprobs"] for r in single]
    assert [r["token_ids"] for r in multi] == [r["token_ids"] for r in single]
    assert all(len(r["logprobs"]) == len(r["token_ids"]) for r in single)


@pytest.mark.parametrize("n", [2, 4])
def test_generate_checks_each_launch_against_eager_steps(
    capsys: pytest.CaptureFixture[str], prompts_file: Path, n: int
) -> None:
    single = _tokens(capsys, prompts_file, "--end-token", "17")
    argv = ["--steps-per-launch", str(n), "--check", "--end-token", "17"]
    assert cli.main(["generate", "--prompts", str(prompts_file), "--json", *EAGER, *argv]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == single
    assert "mismatches: 0" in err


def _overlapped(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps per launch of each overlapped multi-step schedule built from now on."""
    built: list[int] = []
    init = MultiStepOverlapSchedule.__init__

    def spy(self: MultiStepOverlapSchedule, model: Any, post: Any, runner: Any, steps: int) -> None:
        built.append(steps)
        init(self, model, post, runner, steps)

    monkeypatch.setattr(MultiStepOverlapSchedule, "__init__", spy)
    return built


@pytest.mark.parametrize(
    "extra",
    [["--end-token", "17", "--arrive-every", "2"], ["--page-size", "4", "--check-padding"]],
    ids=["end-token", "paged"],
)
def test_generate_with_overlap_prints_the_tokens_of_one_step_per_launch(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    prompts_file: Path,
    extra: list[str],
) -> None:
    single = _tokens(capsys, prompts_file, "--steps-per-launch", "1", *extra)
    built = _overlapped(monkeypatch)
    argv = ["--steps-per-launch", "4", "--overlap", *extra]
    assert _tokens(capsys, prompts_file, *argv) == single
    assert built == [4]  # the run was the overlapped one of 4 steps per launch
    assert len(single) == len(PROMPTS)


def test_the_overlap_demo_checks_n_steps_against_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    built = _overlapped(monkeypatch)
    argv = ["demo", "--runner", "eager", "--steps", "24", "--max-bs", "4", "--overlap"]
    assert cli.main([*argv, "--steps-per-launch", "4"]) == 0
    assert built == [4]
    out = capsys.readouterr().out
    assert "outputs equal to plain greedy" in out
    assert "mismatches: 0" in out
    assert "steps per launch 4: " in out and " syncs per token)" in out


def test_the_demo_checks_n_steps_against_one(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--runner", "eager", "--steps", "24", "--max-bs", "4"]
    assert cli.main([*argv, "--steps-per-launch", "4", "--temperature", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "steps per launch 4:" in out
    assert "mismatches: 0" in out


@pytest.mark.parametrize("overlap", [[], ["--overlap"]], ids=["plain", "overlap"])
def test_the_demo_reports_launches_and_the_sanitized_launches(
    capsys: pytest.CaptureFixture[str], overlap: list[str]
) -> None:
    argv = ["demo", "--runner", "eager", "--steps", "16", "--max-bs", "4", "--check-padding"]
    assert cli.main([*argv, "--steps-per-launch", "4", *overlap]) == 0
    out = capsys.readouterr().out
    if not overlap:  # both captures named: N steps a launch, then the N = 1 reference
        assert re.search(r"capture \(\w+, 4 steps a launch\): sizes \[[0-9, ]+\], [0-9.]+ s", out)
        assert re.search(r"capture \(\w+\): sizes \[[0-9, ]+\], [0-9.]+ s", out)
    launches = int(out.split("steps per launch 4: ")[1].split(" launches")[0])
    assert launches > 0
    assert f"padding sanitizer: {launches} replays checked, no violation" in out


def test_generate_summarises_launches_and_syncs_per_token(
    capsys: pytest.CaptureFixture[str], prompts_file: Path
) -> None:
    """Five prompts of 9 tokens in one graph of 8 rows: the first from the
    prefill, 8 x 5 decode tokens in 2 launches of 4 steps, one read each."""
    argv = ["generate", "--prompts", str(prompts_file), "--json", *EAGER]
    assert cli.main([*argv, "--capture-sizes", "8", "--steps-per-launch", "4"]) == 0
    err = capsys.readouterr().err
    assert "0.050 launches and 0.050 syncs per token" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps-per-launch", "0"], "--steps-per-launch 0: expected 1..8"),
        (["--steps-per-launch", "9"], "--steps-per-launch 9: expected 1..8"),
        (
            ["--steps-per-launch", "2", "--speculative", "mtp"],
            "--steps-per-launch 2 with --speculative: not supported; expected one of them",
        ),
    ],
)
def test_generate_refuses_what_several_steps_per_launch_cannot_serve(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    prompts_file: Path,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
    assert cli.main(["generate", "--prompts", str(prompts_file), *EAGER, *argv]) == 2
    assert capsys.readouterr() == ("", f"graphrunner generate: error: {message}\n")
