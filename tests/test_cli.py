"""``python -m graphrunner demo`` and ``generate``: output, and errors found before any work."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import graphrunner.cli as cli
from graphrunner.engine import Engine, create_model_runner
from graphrunner.model import ModelBundle, default_model, save_checkpoint
from graphrunner.trace import requests_from_prompts
from test_engine import StrayWriter

PROMPTS = [[1, 2, 3], [200], [7, 7, 7, 7, 7, 7, 7, 7], [0, 255, 9, 4]]
EAGER = ["--runner", "eager", "--capture-sizes", "1,2,4"]


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()  # the CLI sets its own (--threads)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def _expected(max_new_tokens: int) -> list[list[int]]:
    bundle = default_model(max_requests=4)
    runner = create_model_runner(bundle, "eager", capture_sizes=[1, 2, 4])
    runner.capture()
    trace = requests_from_prompts(PROMPTS, max_new_tokens=max_new_tokens)
    outputs = Engine(bundle, runner).run(trace).outputs
    return [outputs[i] for i in range(len(PROMPTS))]


def test_generate_prints_greedy_tokens_in_prompt_order(
    prompts_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(
        [
            "generate",
            "--prompts",
            str(prompts_file),
            "--max-new-tokens",
            "6",
            "--arrive-every",
            "2",
            *EAGER,
        ]
    )
    assert rc == 0
    lines = _lines(capsys.readouterr().out)
    assert [line["prompt"] for line in lines] == [0, 1, 2, 3]
    assert [line["tokens"] for line in lines] == _expected(6)


def test_generate_from_a_checkpoint_and_the_cpu_runner_writes_output(
    prompts_file: Path, tmp_path: Path
) -> None:
    save_checkpoint(default_model(max_requests=1).model, tmp_path / "ckpt")
    out = tmp_path / "out.jsonl"
    rc = cli.main(
        [
            "generate",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--prompts",
            str(prompts_file),
            "--max-new-tokens",
            "5",
            "--output",
            str(out),
            "--runner",
            "cpu",
            "--capture-sizes",
            "2,4",
            "--check",
        ]
    )
    assert rc == 0
    assert [line["tokens"] for line in _lines(out.read_text())] == _expected(5)


@pytest.mark.parametrize(
    "content, match",
    [
        ("[1, 2]\n[3, 4\n", r"prompts.jsonl:2: not valid JSON"),
        ("[1, 2]\n\n[3, 256]\n", r"prompts.jsonl:3: token 1 = 256 is not a token id in 0..255"),
        ("[1, -1]\n", r"prompts.jsonl:1: token 1 = -1"),
        ('[1, "a"]\n', r"prompts.jsonl:1: token 1 = 'a'"),
        ('{"ids": [1]}\n', r"prompts.jsonl:1: expected a non-empty JSON list"),
        ("[]\n", r"prompts.jsonl:1: expected a non-empty JSON list"),
        (
            "[1]\n" + json.dumps([5] * 250) + "\n",
            r"prompts.jsonl:2: prompt of 250 tokens \+ 16 new "
            r"tokens needs a context of 265, longer than the model's 256",
        ),
        ("\n", r"has no prompts"),
    ],
)
def test_generate_rejects_bad_prompts_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    content: str,
    match: str,
) -> None:
    monkeypatch.setattr(cli, "_build", lambda *a: pytest.fail("built a model"))
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    assert cli.main(["generate", "--prompts", str(path), *EAGER]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(match, captured.err), captured.err


@pytest.mark.parametrize(
    "args, match",
    [
        (["generate", "--prompts", "nowhere.jsonl"], "prompts file 'nowhere.jsonl' not found"),
        (["demo", "--capture-sizes", "1,x"], "--capture-sizes '1,x'"),
        (["demo", "--capture-sizes", "1,2", "--max-bs", "4"], "--max-bs 4"),
        (["demo", "--runner", "cuda", "--device", "cpu"], "--runner cuda does not run on"),
        (["demo", "--checkpoint", "no/such/dir"], "no/such/dir/config.json"),
        (["demo", "--steps", "0"], "--steps 0"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(
    args: list[str],
    match: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "_build", lambda *a: pytest.fail("built a model"))
    assert cli.main(args) == 2
    assert match in capsys.readouterr().err


def test_demo_reports_and_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "25", "--max-bs", "4", "--runner", "eager"]) == 0
    out = capsys.readouterr().out
    for needle in [
        "device: cpu",
        "runner: eager",
        "capture (eager): sizes [1, 2, 4]",
        "bs=4",
        "decode: 25 steps",
        "tokens/s: graphs",
        "ratio",
        "padded rows:",
        "mismatches: 0",
    ]:
        assert needle in out, needle


def test_demo_exits_1_on_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = cli._capture
    monkeypatch.setattr(
        cli, "_capture", lambda bundle, *a, **k: StrayWriter(real(bundle, *a, **k), bundle)
    )
    assert cli.main(["demo", "--steps", "10", "--max-bs", "2", "--runner", "eager"]) == 1
    out = capsys.readouterr().out
    assert "mismatches: 10" in out


def test_demo_check_padding_checks_every_replay(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--steps", "12", "--max-bs", "4", "--runner", "eager", "--check-padding"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "padding sanitizer: 12 replays checked, no violation" in out


def test_demo_check_padding_exits_1_on_a_stray_write(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_build = cli._build

    def build_with_stray_forward(*a: Any) -> ModelBundle:
        bundle = real_build(*a)
        forward, k_last = bundle.model.forward_decode, bundle.kv_cache.k_buffers[0][-1]

        def stray(*args: Any, **kwargs: Any) -> torch.Tensor:
            k_last.add_(1.0)  # a KV slot no live row owns
            return forward(*args, **kwargs)

        bundle.model.forward_decode = stray  # type: ignore[method-assign]
        return bundle

    monkeypatch.setattr(cli, "_build", build_with_stray_forward)
    args = ["demo", "--steps", "4", "--max-bs", "2", "--runner", "eager", "--check-padding"]
    assert cli.main(args) == 1
    err = capsys.readouterr().err
    assert "padding violation" in err and "k_cache[0]" in err


def test_python_dash_m_runs_the_demo() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphrunner",
            "demo",
            "--steps",
            "8",
            "--max-bs",
            "2",
            "--runner",
            "eager",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "mismatches: 0" in proc.stdout
