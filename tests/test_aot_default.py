"""Warm restarts by default: ``generate`` and ``serve`` save the CPU step's
program in the per-user cache (``<cache root>/aot``, or
``$GRAPHRUNNER_AOT_CACHE``) and the next start loads it instead of compiling;
``--aot-cache none`` saves nothing. The commands run as a new user starts
them: in a subprocess, without the suite's ``GRAPHRUNNER_AOT_CACHE=none``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphrunner_ref.io.aot_folder import AOT_ENV, aot_folder
from serve_world import ROOT, Server

PROMPT = "[1, 2, 3]\n"


def _user_env(cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a user whose cache root is ``cache``."""
    env = {k: v for k, v in os.environ.items() if k != AOT_ENV}
    return {**env, "GRAPHRUNNER_CACHE": str(cache), **extra}


def _generate(env: dict[str, str], prompts: Path, *flags: str) -> tuple[list[int], str]:
    """One ``generate`` run's tokens and its stderr."""
    command = [sys.executable, "-m", "graphrunner", "generate", "--model", "embedded"]
    command += ["--runner", "cpu", "--prompts", str(prompts), "--max-new-tokens", "6", *flags]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["token_ids"], proc.stderr


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(PROMPT)
    return path


def test_generate_saves_by_default_and_the_next_start_loads(tmp_path: Path, prompts: Path) -> None:
    env = _user_env(tmp_path / "cache")
    cold_tokens, cold = _generate(env, prompts)
    folder = tmp_path / "cache" / "aot"
    assert f"program saved in {folder}: later starts load it" in cold
    assert "(cold start)" in cold
    assert any(folder.iterdir()), "nothing was saved"
    warm_tokens, warm = _generate(env, prompts)
    assert f"its saved program loaded from {folder}" in warm
    assert "capture 0.0 s (warm start)" in warm
    assert warm_tokens == cold_tokens


def test_aot_cache_none_saves_nothing(tmp_path: Path, prompts: Path) -> None:
    for flags, extra in (((("--aot-cache", "none")), {}), ((), {AOT_ENV: "none"})):
        _, err = _generate(_user_env(tmp_path / "cache", **extra), prompts, *flags)
        assert "saved" not in err and "later starts" not in err
        assert not (tmp_path / "cache" / "aot").exists()


def test_the_folder_follows_the_flag_then_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRAPHRUNNER_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv(AOT_ENV, raising=False)
    assert aot_folder("auto") == str(tmp_path / "root" / "aot")
    monkeypatch.setenv(AOT_ENV, str(tmp_path / "mine"))
    assert aot_folder("auto") == str(tmp_path / "mine")
    assert aot_folder(str(tmp_path / "flag")) == str(tmp_path / "flag")
    assert aot_folder("none") is None and aot_folder(None) is None
    with pytest.raises(ValueError, match="--aot-cache: '' is empty; expected a folder"):
        aot_folder("")


def test_an_empty_aot_cache_is_refused_by_name(tmp_path: Path, prompts: Path) -> None:
    command = [sys.executable, "-m", "graphrunner", "generate", "--prompts", str(prompts)]
    proc = subprocess.run(
        [*command, "--aot-cache", ""], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2
    assert "--aot-cache: '' is empty; expected a folder, auto or none" in proc.stderr


def test_a_restarted_server_loads_its_sampled_steps_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A served step samples, and skips the sort where no live row draws
    (torch.cond, which a saved program cannot hold): saved whole, it would
    sort every step (2.7x a served SmolLM2 int4-q8 token). Its model is
    saved at the first start and loaded at the next, the sampler run after
    it in process, as the capture lines say; the answers do not change."""
    monkeypatch.delenv(AOT_ENV, raising=False)  # the server's environment is ours plus env
    env = _user_env(tmp_path / "cache")
    starts = []
    for _ in range(2):
        with Server("--model", "embedded", "--runner", "cpu", "--max-bs", "2", env=env) as s:
            status, _, answer = s.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4})
            assert status == 200, answer
            starts.append(("".join(s.log), answer["choices"][0]["token_ids"]))
            assert s.stop() == 0
    (first, first_tokens), (second, second_tokens) = starts
    model = "(the model's; the sampler after it)"
    assert f"program {model} saved in " in first, first
    assert f"its saved program {model} loaded from " in second, second
    assert "not saved" not in first + second
    assert second_tokens == first_tokens
