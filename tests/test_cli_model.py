"""CLI model options: ``--model`` picks an embedded config, ``--dtype`` the
model's dtype, ``--attention`` its decode attention, ``--compile`` is on by
default for the CUDA runner only."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from graphrunner.cli import checks as cli_checks
from graphrunner.cli import main as cli
from graphrunner.cli import model_args as cli_model
from graphrunner.model import default_model, shape_1b_config


class _Stop(Exception):
    """Raised in place of building a model: the test has seen what it needs."""


def _built_with(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []

    def build(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise _Stop

    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (1 << 40, "a fake device"))
    monkeypatch.setattr(cli, "default_model", build)
    with pytest.raises(_Stop):
        cli.main(["demo", "--runner", "eager", "--max-bs", "2", *argv])
    [kwargs] = calls
    return kwargs


def test_model_and_dtype_reach_the_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = _built_with(monkeypatch, ["--model", "1.1b", "--dtype", "bfloat16"])
    assert kwargs["config"] == shape_1b_config()
    assert kwargs["dtype"] == torch.bfloat16
    kwargs = _built_with(monkeypatch, [])
    assert kwargs["config"] is None and kwargs["dtype"] == torch.float32


def test_model_with_a_checkpoint_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--runner", "eager", "--model", "1.1b", "--checkpoint", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "--model 1.1b: an embedded model, not with --checkpoint" in capsys.readouterr().err


def test_bfloat16_demo_runs_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--runner", "eager", "--steps", "6", "--max-bs", "2", "--dtype", "bfloat16"]
    assert cli.main(argv) == 0
    assert "mismatches: 0" in capsys.readouterr().out


def test_bfloat16_model_is_bfloat16_throughout() -> None:
    bundle = default_model(max_requests=1, dtype=torch.bfloat16)
    assert {p.dtype for p in bundle.model.parameters()} == {torch.bfloat16}
    assert bundle.kv_cache.k_buffers[0].dtype == torch.bfloat16


@pytest.mark.parametrize("choice", ["triton", "triton-all-heads"])
def test_attention_triton_needs_cuda(capsys: pytest.CaptureFixture[str], choice: str) -> None:
    argv = ["demo", "--runner", "eager", "--device", "cpu", "--attention", choice]
    assert cli.main(argv) == 2
    assert f"--attention {choice} needs a CUDA device; the device here is cpu" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("choice", "kernel", "layout"),
    [
        ("auto", "triton", "per_head"),
        ("torch", "torch", "per_head"),
        ("triton", "triton", "per_head"),
        ("triton-all-heads", "triton", "all_heads"),
    ],
)
def test_attention_reaches_the_backend(choice: str, kernel: str, layout: str) -> None:
    bundle = default_model(max_requests=1)
    bundle.model.attn_backend.kernel = "triton"  # as on CUDA
    cli_model.with_attention(argparse.Namespace(attention=choice), bundle)
    assert (bundle.model.attn_backend.kernel, bundle.model.attn_backend.layout) == (kernel, layout)
