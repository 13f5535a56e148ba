"""``--quantize int8 | fp16`` on ``generate`` and ``demo``: the tokens of
transformers holding the same compact weights, and every refusal naming the
flag."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from test_quantize import _stored_copy
from torch import nn

from graphrunner_ref.cli import main as cli
from graphrunner_ref.engine.workload import Request
from hf_tiny import hf_greedy, save_tiny_llama

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 2, 3], [200], [7, 7, 7, 7, 7, 7, 7, 7], [0, 255, 9, 4, 31]]
NEW = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    path = tmp_path_factory.mktemp("cli-quantize")
    return path, save_tiny_llama(path)


def _hf_tokens(hf: nn.Module, mode: str) -> list[list[int]]:
    requests = [Request(i, tuple(p), NEW) for i, p in enumerate(PROMPTS)]
    tokens = hf_greedy(_stored_copy(hf, mode), requests)
    return [tokens[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize(("mode", "runner"), [("int8", "eager"), ("fp16", "cpu")])
def test_generate_quantized_prints_transformers_tokens(
    tiny: tuple[Path, nn.Module],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mode: str,
    runner: str,
) -> None:
    path, hf = tiny
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    argv = ["generate", "--model", str(path), "--prompts", str(prompts), "--quantize", mode]
    argv += ["--runner", runner, "--capture-sizes", "1,2,4", "--max-new-tokens", str(NEW)]
    assert cli.main([*argv, "--json", "--check", "--check-padding", "--quiet"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in records] == _hf_tokens(hf, mode)


def test_demo_quantized_graphs_equal_eager(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--quantize", "fp16", "--runner", "eager", "--max-bs", "4", "--steps", "20"]
    assert cli.main(argv) == 0
    assert "mismatches: 0" in capsys.readouterr().out


def test_an_unknown_mode_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.main(["demo", "--runner", "eager", "--quantize", "int2"])
    assert stop.value.code == 2
    assert "argument --quantize: invalid choice: 'int2'" in capsys.readouterr().err


def test_fp16_weights_on_a_half_precision_model_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "demo",
        "--runner",
        "eager",
        "--steps",
        "5",
        "--quantize",
        "fp16",
        "--dtype",
        "bfloat16",
    ]
    assert cli.main(argv) == 2
    assert "--quantize fp16 runs float32 activations over compact weights; --dtype bfloat16" in (
        capsys.readouterr().err
    )
    argv[argv.index("fp16")] = "int4"
    assert cli.main(argv) == 2
    assert (
        "--quantize int4 runs float32 activations over compact weights; --dtype bfloat16: "
        "expected float32" in capsys.readouterr().err
    )


def test_quantize_on_a_mamba_checkpoint_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hf_ssm import save_tiny_mamba

    save_tiny_mamba(tmp_path / "ck")
    argv = ["generate", "--model", str(tmp_path / "ck"), "--prompt", "[1, 2]", "--quantize", "int8"]
    assert cli.main([*argv, "--runner", "eager"]) == 2
    assert "--quantize is not supported for a Mamba or Jamba checkpoint" in capsys.readouterr().err


def test_int8_on_a_cpu_without_avx512_notes_the_fast_path(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Half-precision int8 runs torch's product (slow without AVX-512 or AMX);
    float32 int8 runs the C++ kernel, with no note where it builds."""
    from graphrunner_ref.model import cpu_features
    from graphrunner_ref.model.cpu_kernels import kernel_status

    monkeypatch.setattr(cpu_features.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpu_features, "half_precision_units", lambda: [])
    demo = ["demo", "--runner", "eager", "--steps", "3", "--quantize", "int8"]
    assert cli.main([*demo, "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "weight-only int8 matmuls run slower than float32 here; --quantize fp16" in err
    assert cli.main(demo) == 0
    err = capsys.readouterr().err
    if kernel_status() is None:
        assert "slower than float32" not in err
        assert "--quantize int8: products: the C++ AVX2 kernels (CPU capability AVX2)" in err
    else:
        assert "the C++ int8 kernel does not run here" in err
    monkeypatch.setattr(cpu_features.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert cli.main([*demo, "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "weight-only int8 matmuls run slower" not in err
    assert "products: torch's weight-only int8 product (half-precision activations)" in err


def test_int8_from_gguf_q8_0_and_q4_weights_gives_transformers_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GGUF holding Q8_0, Q4_0 and Q4_1 projections: generate --quantize int8
    requantizes the dequantized weights per channel and prints the tokens of
    transformers holding those int8 values."""
    from gguf_world import MIXED_TYPES, tiny_text_checkpoint, write_gguf
    from graphrunner_ref.io import resolve_checkpoint
    from graphrunner_ref.io.gguf_cache import CACHE_ENV

    assert {"Q8_0", "Q4_0", "Q4_1"} <= set(MIXED_TYPES.values())
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    write_gguf(tiny_text_checkpoint(tmp_path / "hf"), tmp_path / "hf", tmp_path / "m.gguf")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    argv = ["generate", "--model", str(tmp_path / "m.gguf"), "--prompts", str(prompts)]
    argv += ["--quantize", "int8", "--runner", "eager", "--max-new-tokens", str(NEW)]
    assert cli.main([*argv, "--prompts-format", "ids", "--json", "--quiet"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    converted = transformers.LlamaForCausalLM.from_pretrained(
        resolve_checkpoint(tmp_path / "m.gguf")
    ).eval()
    assert [r["token_ids"] for r in records] == _hf_tokens(converted, "int8")


def test_a_first_build_of_the_kernels_says_how_long_it_took(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A load that took longer than a cached one says it built the kernels
    (here: the clock says 30 s passed); a quick load says nothing."""
    import graphrunner_ref.cli.model_args as model_args

    ticks = iter([100.0, 130.0])
    monkeypatch.setattr(model_args.time, "perf_counter", lambda: next(ticks))
    model_args.check_quantize(argparse.Namespace(quantize="fp16", device="cpu", dtype="float32"))
    assert "--quantize fp16: built the C++ CPU kernels in 30 s" in capsys.readouterr().err
    ticks = iter([100.0, 100.1])
    model_args.check_quantize(argparse.Namespace(quantize="fp16", device="cpu", dtype="float32"))
    assert "built the C++ CPU kernels" not in capsys.readouterr().err
