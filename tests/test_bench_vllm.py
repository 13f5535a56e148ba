"""The vLLM peer of ``bench/bench_real_cpu.py`` where vLLM is not there: the
variant is left out of the default and refused, by name, with what to set."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import bench_real_cpu
from bench.vllm_cpu_run import VLLM_PYTHON, vllm_available, vllm_cpu_run


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
