"""The README's examples run as written: the declarations, the usage
example (with the eager runner, so the test does not compile graphs), whose
replays pass the sanitizer, and "Plug in your own model", which is
``examples/own_model.py`` word for word."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

import graphrunner
from conftest import SLOW

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "own_model.py"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_model", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_usage_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = [b for b in _python_blocks() if b != EXAMPLE.read_text()]
    usage = [b for b in blocks if "create_runner" in b]
    assert len(usage) == 1, "expected one usage example in the README"
    for block in blocks:
        if block is not usage[0]:
            exec(compile(block, str(README), "exec"), {})
    monkeypatch.setattr(graphrunner, "best_runner_kind", lambda: "eager")
    scope: dict[str, object] = {}
    exec(compile(usage[0], str(README), "exec"), scope)
    runner = scope["runner"]
    assert isinstance(runner, graphrunner.GraphRunner) and runner.kind == "eager"
    assert runner.stats.replays == 4 and runner.stats.padded_rows == 4  # 3 rows -> graph of 4
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked == 4
    assert "total" in capsys.readouterr().out


def test_readme_examples_import_only_the_public_api() -> None:
    """Everything a user needs is importable from ``graphrunner`` itself:
    ``__all__`` is the contract, and the examples prove it."""
    blocks = _python_blocks()
    deep = [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if re.match(r"\s*(from|import) graphrunner\.", line)
    ]
    assert deep == []
    assert sorted(graphrunner.__all__) == sorted(set(graphrunner.__all__))
    missing = [name for name in graphrunner.__all__ if not hasattr(graphrunner, name)]
    assert missing == []


def test_the_own_model_section_is_the_example_file() -> None:
    assert _python_blocks().count(EXAMPLE.read_text()) == 1


def test_the_own_model_example_replays_padded_equal_to_eager(
    capsys: pytest.CaptureFixture[str],
) -> None:
    worst = _example().main("eager")
    assert worst < 1e-5
    out = capsys.readouterr().out
    assert "replays=4" in out and "live_rows=12" in out and "padded_rows=4" in out


@pytest.mark.skipif(not SLOW, reason="compiles three sizes: GRAPHRUNNER_SLOW=1")
def test_the_own_model_example_on_the_cpu_runner() -> None:
    assert _example().main("cpu") < 1e-5


def test_the_own_model_sanitizer_catches_a_padded_row_writing_live_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The example's guard can fail: a forward whose padded row writes row 4
    (a request outside the batch) instead of the sink row 0, at the batch's
    last position, is stopped at the first replay where that changes a value."""
    example = _example()

    def stray(self: torch.nn.Module, b: graphrunner.StepInputs) -> torch.Tensor:
        padded = b.req_pool_indices == 0
        rows = torch.where(padded, 4, b.req_pool_indices)
        positions = torch.where(padded, b.positions.max(), b.positions)
        self.history[rows, positions] = self.embed(b.input_ids)
        return self.head(self.history[b.req_pool_indices].sum(1))

    monkeypatch.setattr(example.BagOfTokens, "forward", stray)
    with pytest.raises(graphrunner.PaddingViolation, match="history"):
        example.main("eager")
