"""``graphrunner demo --trace-out FILE``: a torch profiler trace (Chrome /
Perfetto JSON) in which graphrunner's capture, populate and replay ranges
appear by name; written only when the run completes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

import graphrunner_ref.cli.main as cli
from graphrunner.util import nvtx
from graphrunner_ref.engine import serving


def _range_names(path: Path) -> Counter[str]:
    events = json.loads(path.read_text())["traceEvents"]
    prefix = f"{nvtx.DOMAIN}::"
    # Host ranges only: on a GPU the profiler also mirrors a range onto each
    # stream its kernels ran on ("gpu_user_annotation").
    return Counter(
        e["name"][len(prefix) :]
        for e in events
        if e.get("name", "").startswith(prefix) and e.get("cat") != "gpu_user_annotation"
    )


def _demo(path: Path, *extra: str) -> int:
    args = ["demo", "--steps", "6", "--capture-sizes", "2,4", "--trace-out", str(path)]
    return cli.main([*args, *extra])


def test_capture_populate_and_replay_ranges_appear_by_name(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert _demo(path, "--runner", "eager") == 0
    assert "profiler trace written to" in capsys.readouterr().out
    names = _range_names(path)
    assert names["capture eager"] == 1
    assert names["capture bs=4"] == names["capture bs=2"] == 1
    replays = sum(n for name, n in names.items() if name.startswith("replay bs="))
    populates = sum(n for name, n in names.items() if name.startswith("populate bs="))
    assert replays == populates == 6  # one per decode step
    assert list(tmp_path.iterdir()) == [path]  # no temporary left beside it


def test_no_trace_when_the_run_fails(tmp_path, monkeypatch):
    class Broken:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def run(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("engine failed")

    monkeypatch.setattr(serving, "Engine", Broken)
    with pytest.raises(RuntimeError, match="engine failed"):
        _demo(tmp_path / "trace.json", "--runner", "eager")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.cuda
def test_cuda_trace_has_the_ranges_and_device_kernels(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path = tmp_path / "trace.json"
    assert _demo(path, "--runner", "cuda") == 0
    names = _range_names(path)
    # "capture cuda+compile": --runner cuda compiles the reference model by default.
    assert sum(n for name, n in names.items() if name.startswith("capture cuda")) == 1
    assert names["capture bs=4"] == 1
    assert sum(n for name, n in names.items() if name.startswith("replay bs=")) == 6
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
