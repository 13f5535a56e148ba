"""The vLLM peer of ``bench/bench_real_cpu.py``: where vLLM is not there the
variant is left out of the default and refused, by name, with what to set;
its child (over a stand-in ``vllm``) loads once and decodes a round each time
asked, its failures and silences are reported with its log and bounded; a
row's ratio to vLLM is per round, against its faster dtype."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

import bench.vllm_cpu_run as vllm_cpu_run_module
from bench import bench_real_cpu
from bench.vllm_cpu_run import VLLM_PYTHON, VllmDecoder, vllm_available, vllm_cpu_run


def test_unset_or_not_a_python_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VLLM_PYTHON, raising=False)
    assert not vllm_available()
    monkeypatch.setenv(VLLM_PYTHON, "/nonexistent/bin/python")
    assert not vllm_available()
    with pytest.raises(RuntimeError, match=VLLM_PYTHON):
        vllm_cpu_run(Path("."), [[1]], 1, 2, "float32")


def test_vllm_variant_refused_when_unavailable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(VLLM_PYTHON, raising=False)
    assert "vllm" not in bench_real_cpu.default_variants()
    assert bench_real_cpu.variants_error(["cpu", "int4"]) is None
    with pytest.raises(SystemExit) as stop:
        bench_real_cpu.main(["--variants", "cpu,vllm-bf16", "--batches", "8"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "vllm-bf16: vLLM is not available" in err and VLLM_PYTHON in err


def test_vllm_variant_offered_when_a_python_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VLLM_PYTHON, sys.executable)
    assert bench_real_cpu.default_variants().endswith("vllm-bf16,vllm-fp32")
    assert bench_real_cpu.variants_error(["vllm-fp32"]) is None
    assert "vllm-int4" in (bench_real_cpu.variants_error(["vllm-int4"]) or "")


_FAKE_VLLM = """
import os, time

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, detokenize):
        self.max_tokens = max_tokens

class _Tokens:
    def __init__(self, ids):
        self.token_ids = ids

class _Output:
    def __init__(self, ids):
        self.outputs = [_Tokens(ids)]

class LLM:
    loads = 0

    def __init__(self, model, dtype, **options):
        if model == "broken":
            raise ValueError("no such checkpoint: broken")
        time.sleep(float(os.environ.get("FAKE_VLLM_LOAD_S", "0")))
        LLM.loads += 1

    def reset_prefix_cache(self):
        self.cached = set()
        return True

    def generate(self, inputs, params, use_tqdm=False):
        # A prompt's tokens: its sum, then each next one, plus the loads so far
        # (a reload between rounds would change them). A prompt not in the
        # prefix cache takes longer: a round's timed calls must both find it.
        cached = getattr(self, "cached", set())
        fresh = [tuple(p["prompt_token_ids"]) not in cached for p in inputs]
        self.cached = cached | {tuple(p["prompt_token_ids"]) for p in inputs}
        time.sleep(0.002 * params.max_tokens + 0.05 * any(fresh))
        start = [sum(p["prompt_token_ids"]) + 100 * LLM.loads for p in inputs]
        return [_Output(list(range(s, s + params.max_tokens))) for s in start]
"""


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A python whose ``vllm`` is a stand-in (vLLM's child protocol without vLLM)."""
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(_FAKE_VLLM)
    (package / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={package.parent} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv(VLLM_PYTHON, str(python))
    return python


def test_the_child_loads_once_and_decodes_a_round_each_time_asked(fake_vllm: Path) -> None:
    decoder = VllmDecoder(Path("model"), [[1, 2], [3], [4, 4]], 2, 3, "bfloat16")
    try:
        assert decoder.who == "vLLM CPU engine, --dtype bfloat16"
        rounds = [decoder.decode() for _ in range(3)]
    finally:
        decoder.close()
    for tps, tokens in rounds:
        # 2 steps of 2 ms a group, timed without the 50 ms of a fresh prefill
        assert tps > 2 * 2 / 0.05, tps
        assert tokens == [[103, 104, 105], [103, 104, 105], [108, 109, 110]]  # loaded once
    decoder.close()  # a second close does nothing


def test_a_child_that_fails_to_load_is_reported_with_its_log(fake_vllm: Path) -> None:
    with pytest.raises(RuntimeError, match=r"(?s)it exited.*no such checkpoint: broken"):
        VllmDecoder(Path("broken"), [[1]], 1, 2, "float32")


def test_a_child_that_does_not_answer_in_time_is_killed(
    fake_vllm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_LOAD_S", "60")
    monkeypatch.setattr(vllm_cpu_run_module, "LOAD_S", 1.0)
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no answer within 1 s"):
        VllmDecoder(Path("model"), [[1]], 1, 2, "float32")
    assert time.monotonic() - begin < 20  # killed, not waited for


def test_a_bad_dtype_is_refused_by_name(fake_vllm: Path) -> None:
    with pytest.raises(ValueError, match=r"dtype 'float16': expected one of bfloat16, float32"):
        VllmDecoder(Path("model"), [[1]], 1, 2, "float16")


def test_a_row_is_held_against_vllms_faster_dtype_round_by_round() -> None:
    figures = {
        bench_real_cpu.TRANSFORMERS: [10.0, 20.0, 10.0],
        "vllm-bf16": [100.0, 50.0, 100.0],
        "vllm-fp32": [40.0, 40.0, 40.0],
        "int4-q8": [150.0, 100.0, 120.0],
    }
    tokens = [[[1]] * 8] * 3
    row = bench_real_cpu.rounds_row("int4-q8", figures, tokens, [list(figures)] * 3, [[1]] * 8)
    assert row["vllm_baseline"] == "vllm-bf16"  # median 100 against 40
    assert row["vs_vllm_per_round"] == [1.5, 2.0, 1.2]
    assert row["vs_vllm"] == 1.5  # the median of the rounds' ratios, not of medians (1.2)
