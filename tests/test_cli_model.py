"""CLI model options: ``--model`` takes a checkpoint directory, a ``.gguf``
file or an embedded model's name (``--checkpoint`` another name for it),
``--dtype`` the model's dtype, ``--attention`` its decode attention, ``--compile`` is on by
default for the CUDA runner only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import graphrunner_ref.engine.kinds.llama as llama_kind
from graphrunner_ref.cli import checks as cli_checks
from graphrunner_ref.cli import main as cli
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.kinds.llama import with_attention
from graphrunner_ref.io import save_checkpoint
from graphrunner_ref.io.gguf_cache import CACHE_ENV
from graphrunner_ref.model import default_model, shape_1b_config
from test_gguf_hostile import write as write_gguf


class _Stop(Exception):
    """Raised in place of building a model: the test has seen what it needs."""


def _built_with(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], builder: str = "default_model"
) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []

    def build(*args: Any, **kwargs: Any) -> None:
        calls.append({"args": args, **kwargs})
        raise _Stop

    monkeypatch.setattr(cli_checks, "available_memory", lambda device: (1 << 40, "a fake device"))
    monkeypatch.setattr(llama_kind, builder, build)
    with pytest.raises(_Stop):
        cli.main(["demo", "--runner", "eager", "--max-bs", "2", *argv])
    [kwargs] = calls
    return kwargs


def test_model_and_dtype_reach_the_embedded_model(monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = _built_with(monkeypatch, ["--model", "embedded-1.1b", "--dtype", "bfloat16"])
    assert kwargs["config"] == shape_1b_config()
    assert kwargs["dtype"] == torch.bfloat16
    for argv in ([], ["--model", "embedded"]):
        kwargs = _built_with(monkeypatch, argv)
        assert kwargs["config"] is None and kwargs["dtype"] == torch.float32


@pytest.mark.parametrize(("old", "new"), [("default", "embedded"), ("1.1b", "embedded-1.1b")])
def test_the_earlier_embedded_names_still_work_with_a_note(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], old: str, new: str
) -> None:
    kwargs = _built_with(monkeypatch, ["--model", old])
    assert kwargs["config"] == (None if new == "embedded" else shape_1b_config())
    assert f"--model {old} is deprecated; use --model {new}" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--model", "--checkpoint"])
def test_a_checkpoint_directory_reaches_the_loader(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flag: str
) -> None:
    save_checkpoint(default_model(max_requests=1).model, tmp_path / "ckpt")
    kwargs = _built_with(monkeypatch, [flag, str(tmp_path / "ckpt")], builder="load_any")
    assert kwargs["args"] == (tmp_path / "ckpt",)


def test_a_gguf_file_as_model_is_converted_and_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    gguf = write_gguf(tmp_path / "tiny.gguf")
    kwargs = _built_with(monkeypatch, ["--model", str(gguf)], builder="load_any")
    [loaded] = kwargs["args"]
    assert loaded.parent == tmp_path / "cache" / "checkpoints"
    assert (loaded / "config.json").is_file()


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["demo", "--runner", "eager", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.splitlines()
    return line


def test_model_with_a_checkpoint_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(["--model", "embedded-1.1b", "--checkpoint", str(tmp_path)], capsys)
    assert f"--model embedded-1.1b: an embedded model, not with --checkpoint {tmp_path}" in err
    save_checkpoint(default_model(max_requests=1).model, tmp_path / "ckpt")
    other = tmp_path / "other"
    err = _refused(["--model", str(tmp_path / "ckpt"), "--checkpoint", str(other)], capsys)
    assert f"--model {tmp_path / 'ckpt'} and --checkpoint {other}: two different models" in err


def test_both_flags_naming_one_checkpoint_are_one_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    save_checkpoint(default_model(max_requests=1).model, tmp_path / "ckpt")
    both = ["--model", str(tmp_path / "ckpt"), "--checkpoint", str(tmp_path / "ckpt")]
    assert _built_with(monkeypatch, both, builder="load_any")["args"] == (tmp_path / "ckpt",)


def test_a_hub_id_is_not_fetched_and_says_how_to_get_a_copy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _refused(["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"], capsys)
    assert err == (
        "graphrunner demo: error: --model HuggingFaceTB/SmolLM2-135M-Instruct: no such file or "
        "directory; Hugging Face hub ids are not fetched; download a local copy first "
        "(huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR), "
        "then --model DIR"
    )


def test_a_directory_without_config_says_how_to_get_a_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--model", "--checkpoint"):
        err = _refused([flag, str(tmp_path)], capsys)
        assert f"{flag} {tmp_path}: missing {tmp_path / 'config.json'}; " in err
        assert "huggingface-cli download ORG/NAME --local-dir DIR), then --model DIR" in err


@pytest.mark.parametrize("value", ["no-such-model", "no/such/dir", "missing.gguf", "a/b.gguf"])
def test_a_missing_path_lists_the_embedded_names(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert _refused(["--model", value], capsys) == (
        f"graphrunner demo: error: --model {value}: no such file or directory; expected a "
        "checkpoint directory, a .gguf file or an embedded model (embedded, embedded-1.1b)"
    )


def test_a_file_that_is_not_gguf_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert _refused(["--model", str(tmp_path / "weights.bin")], capsys).endswith(
        f"--model {tmp_path / 'weights.bin'}: expected a checkpoint directory or a .gguf file"
    )


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
    with_attention(EngineConfig(attention=choice), bundle)
    assert (bundle.model.attn_backend.kernel, bundle.model.attn_backend.layout) == (kernel, layout)
