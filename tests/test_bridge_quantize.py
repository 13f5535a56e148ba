"""Compact weights through the transformers bridge: ``quantize_linears``
replaces a model's ``nn.Linear`` projections (biased, packed and tied-head
ones included) and the bridge then answers as transformers does with the
same weights dequantized (transformers is the oracle), through padded replay
under the sanitizer; ``generate --model-impl transformers --quantize`` runs it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import graphrunner_ref.cli.main as cli
from graphrunner_ref import Engine, Request, create_decode_runner
from graphrunner_ref.bridge import load_transformers
from graphrunner_ref.bridge.quantize import QKV_NAMES, BiasedLinear, quantize_linears
from graphrunner_ref.model.int4_bf16 import Int4Bf16Linear
from graphrunner_ref.model.int4_linear import Int4Linear
from graphrunner_ref.model.int4_q8 import Int4Q8Linear
from graphrunner_ref.model.quantize import bf16_units
from hf_tiny import TINY_DECODER, hf_greedy, save_decoders

transformers = pytest.importorskip("transformers")

TRACE = [
    Request(0, (3, 17, 5, 9, 22, 7), 6),
    Request(1, (11, 2), 5, arrival_step=1),
    Request(2, (40, 41, 42, 43), 4, arrival_step=2),
]
CONFIGS = {
    "qwen2-biases": lambda t: t.Qwen2Config(**TINY_DECODER),
    "phi3-packed": lambda t: t.Phi3Config(**TINY_DECODER, pad_token_id=0),
    "gemma-tied": lambda t: t.GemmaConfig(**TINY_DECODER, head_dim=8),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    configs = {name: make(transformers) for name, make in CONFIGS.items()}
    return save_decoders(tmp_path_factory, configs, random_biases=True)


def _dequantized_reference(reference: nn.Module, quantized: nn.Module) -> nn.Module:
    """``reference`` with each linear's weight what ``quantized``'s compact one multiplies by."""
    ref = copy.deepcopy(reference)
    compact = dict(quantized.named_modules())
    with torch.no_grad():
        for name, linear in ref.named_modules():
            if isinstance(linear, nn.Linear):
                module = compact[name]
                inner = module.inner if isinstance(module, BiasedLinear) else module
                linear.weight.copy_(inner.dequantized())
    return ref


@pytest.mark.parametrize("mode", ["fp16", "int4"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_quantized_bridge_equals_transformers_with_the_same_weights(
    arch: str, mode: str, saved: dict[str, tuple[Path, Any]]
) -> None:
    path, reference = saved[arch]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    linears = sum(isinstance(m, nn.Linear) for m in bundle.model.hf.modules())
    assert quantize_linears(bundle.model.hf, mode) == linears
    assert not any(isinstance(m, nn.Linear) for m in bundle.model.hf.modules())
    oracle = _dequantized_reference(reference, bundle.model.hf)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2, 4], check_padding=True)
    runner.capture()
    result = Engine(bundle, runner).run(TRACE)
    assert result.outputs == hf_greedy(oracle, TRACE)
    assert runner.stats.padded_rows > 0


def test_the_weights_change_the_answers(saved: dict[str, tuple[Path, Any]]) -> None:
    """The oracle above can fail: int4's weights answer differently from the float model's."""
    path, reference = saved["qwen2-biases"]
    bundle = load_transformers(path, max_requests=4, max_context_len=32)
    quantize_linears(bundle.model.hf, "int4")
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4])
    runner.capture()
    assert Engine(bundle, runner).run(TRACE).outputs != hf_greedy(reference, TRACE)


@pytest.mark.parametrize(("arch", "qkv"), [("qwen2-biases", 3), ("phi3-packed", 1)])
def test_int4_q8_keeps_wide_inputs_for_q_k_and_v(
    arch: str, qkv: int, saved: dict[str, tuple[Path, Any]]
) -> None:
    """As the native model: int4-q8's q/k/v projections (each alone, or packed)
    are int4 with wider activations (bfloat16 where the CPU multiplies it,
    else float32: ``wide_int4_linear``), every other projection int4 x q8."""
    path, _ = saved[arch]
    bundle = load_transformers(path, max_requests=1, max_context_len=8)
    quantize_linears(bundle.model.hf, "int4-q8")
    kinds: dict[str, set[type]] = {}
    for name, module in bundle.model.hf.named_modules():
        inner = module.inner if isinstance(module, BiasedLinear) else module
        if isinstance(inner, Int4Linear) and not name.endswith(".inner"):
            kinds.setdefault(name.rpartition(".")[2], set()).add(type(inner))
    wide = {Int4Bf16Linear if bf16_units() else Int4Linear}
    float_inputs = {n for n, k in kinds.items() if k == wide}
    assert len(float_inputs) == qkv and float_inputs <= QKV_NAMES, kinds
    assert all(k == {Int4Q8Linear} for n, k in kinds.items() if n not in QKV_NAMES), kinds


def test_biases_are_kept(saved: dict[str, tuple[Path, Any]]) -> None:
    path, reference = saved["qwen2-biases"]
    bundle = load_transformers(path, max_requests=1, max_context_len=8)
    quantize_linears(bundle.model.hf, "fp16")
    q_proj = bundle.model.hf.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, BiasedLinear)
    assert torch.equal(q_proj.bias, reference.model.layers[0].self_attn.q_proj.bias)


def test_bad_modes_and_models_are_refused_by_name(saved: dict[str, tuple[Path, Any]]) -> None:
    path, _ = saved["qwen2-biases"]
    bundle = load_transformers(path, max_requests=1, max_context_len=8)
    with pytest.raises(ValueError, match=r"quantize='int3': expected one of int8, fp16, int4"):
        quantize_linears(bundle.model.hf, "int3")
    half = load_transformers(path, max_requests=1, max_context_len=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"quantize='fp16' .* dtype is torch.bfloat16"):
        quantize_linears(half.model.hf, "fp16")
    quantize_linears(bundle.model.hf, "fp16")
    with pytest.raises(ValueError, match=r"has no nn.Linear to replace \(quantized already\?\)"):
        quantize_linears(bundle.model.hf, "fp16")


def test_generate_quantizes_the_bridges_linears(
    saved: dict[str, tuple[Path, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, reference = saved["phi3-packed"]
    prompts, out = tmp_path / "prompts.ids", tmp_path / "out.jsonl"
    prompts.write_text("[3, 17, 5, 9]\n")
    argv = ["generate", "--model", str(path), "--model-impl", "transformers", "--quantize"]
    argv += ["fp16", "--runner", "eager", "--prompts", str(prompts), "--prompts-format", "ids"]
    assert cli.main([*argv, "-n", "5", "--output", str(out)]) == 0
    record = json.loads(out.read_text().splitlines()[0])
    linears = sum(isinstance(m, nn.Linear) for m in reference.modules())
    assert f"--quantize fp16: {linears} nn.Linear modules replaced; products:" in (
        capsys.readouterr().err
    )
    bundle = load_transformers(path, max_requests=1, max_context_len=16)
    quantize_linears(bundle.model.hf, "fp16")
    oracle = _dequantized_reference(reference, bundle.model.hf)
    expected = hf_greedy(oracle, [Request(0, (3, 17, 5, 9), 5)])[0]
    assert record["token_ids"][: len(expected)] == expected
