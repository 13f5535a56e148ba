"""``bench.bench_vllm_serve`` without vLLM and over a stand-in load
generator: it refuses to run without ``GRAPHRUNNER_VLLM_PYTHON``, every row is
held against vLLM's of the same workload, and a server that exits at once is
reported with its log instead of being waited for; `--only` and `--skip`
pick the contenders by label."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

import bench.bench_vllm_serve as b


def test_without_vllm_it_says_so_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("GRAPHRUNNER_VLLM_PYTHON", raising=False)
    assert b.main(["--model", "nowhere"]) == 2
    assert "GRAPHRUNNER_VLLM_PYTHON" in capsys.readouterr().err


def test_each_row_is_held_against_vllms_of_its_workload(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(b, "RESULTS_DIR", tmp_path)
    row = dict.fromkeys(("completed", "median_ttft_ms", "p99_ttft_ms"), 1.0)
    row |= {"median_itl_ms": 1.0, "p99_itl_ms": 1.0}
    rows = {
        "w1": {
            "vLLM CPU, bfloat16": {**row, "output_throughput": 60.0},
            "vLLM CPU, float32": {**row, "output_throughput": 80.0},
            "graphrunner a": {**row, "output_throughput": 40.0},
        },
        "w2": {"graphrunner a": {**row, "output_throughput": 10.0}},
    }
    args = argparse.Namespace(name="t", model="m", num_prompts=4, concurrency=2)
    b.write_results(args, rows)
    text = (tmp_path / "vllm-bench-serve-t.md").read_text()
    assert "| w1 | vLLM CPU, float32 | 80.0 | 1.00x |" in text  # vLLM's fastest
    assert "| w1 | vLLM CPU, bfloat16 | 60.0 | 0.75x |" in text
    assert "| w1 | graphrunner a | 40.0 | 0.50x |" in text
    assert "| w2 | graphrunner a | 10.0 | — |" in text  # no vLLM row: no ratio


def test_a_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    quits = b.Contender(
        "quits", (sys.executable, "-c", "print('no model here'); raise SystemExit(3)")
    )
    refused = pytest.raises(RuntimeError, match=r"exited \(3\)[\s\S]*no model here")
    with refused, b.serving(quits, b.free_port(), tmp_path):
        pass


def test_only_and_skip_pick_the_contenders_by_label() -> None:
    chosen = b._chosen
    label = "graphrunner int4-q8 kv16, --prefill-bf16"
    assert chosen(label, "", "")
    assert chosen(label, "vLLM,kv16", "")
    assert not chosen(label, "vLLM", "")
    assert not chosen(label, "kv16", "prefill-bf16")
    assert chosen("graphrunner int4-q8 kv16", "kv16", "prefill-bf16,")
