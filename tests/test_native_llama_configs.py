"""Llama checkpoints the native model runs besides the plain ones: Llama 3.1's
RoPE scaling (``rope_type: llama3``, the scaled frequencies equal to
transformers' own) and attention / MLP biases. Tiny random checkpoints saved
by transformers load natively and their padded greedy decode equals
transformers' ``generate`` token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from graphrunner_ref import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_model, read_config
from graphrunner_ref.model.config import Llama3Rope, ModelConfig, UnsupportedModelError
from hf_tiny import hf_greedy

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
TRACE = [Request(0, (5, 9, 2, 200, 31, 7), 12), Request(1, (17,) * 20, 12), Request(2, (3, 4), 12)]


def _save(path: Path, **extra: object) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, rope_parameters={**LLAMA3, "rope_theta": 500000.0}, **extra,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def test_llama3_rope_decodes_as_transformers(tmp_path: Path) -> None:
    hf = _save(tmp_path)
    config = read_config(tmp_path)
    assert config.rope_scaling == Llama3Rope(8.0, 1.0, 4.0, 16)
    bundle = load_model(tmp_path, max_requests=4, max_context_len=64)
    hf_freq = hf.model.rotary_emb.inv_freq.float()
    theta = torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim
    ours = config.rope_scaling.scale(1.0 / (config.rope_theta**theta))
    torch.testing.assert_close(ours, hf_freq, rtol=0, atol=0)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4])  # 3 live rows: padded
    runner.capture()
    assert Engine(bundle, runner).run(TRACE).outputs == hf_greedy(hf, TRACE)


def test_the_hf_config_round_trips_and_other_scalings_name_the_bridge() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    }  # fmt: skip
    config = ModelConfig.from_hf_dict({**base, "rope_scaling": {**LLAMA3, "rope_theta": 5e5}})
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    with pytest.raises(UnsupportedModelError, match="'yarn' is not supported by the native"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="missing \\['high_freq_factor'"):
        ModelConfig.from_hf_dict(
            {**base, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "high_freq_factor"}}
        )


@pytest.mark.parametrize("kind", ["eager", "cpu"])
def test_attention_and_mlp_biases_decode_as_transformers(tmp_path: Path, kind: str) -> None:
    hf = _save(tmp_path, attention_bias=True, mlp_bias=True)
    with torch.no_grad():  # biases large enough to change the tokens
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    config = read_config(tmp_path)
    assert (config.attention_bias, config.mlp_bias) == (True, True)
    bundle = load_model(tmp_path, max_requests=4, max_context_len=64)
    runner = create_decode_runner(bundle, kind, capture_sizes=[1, 4], check_padding=True)
    runner.capture()
    expected = hf_greedy(hf, TRACE)
    assert Engine(bundle, runner).run(TRACE).outputs == expected
    with torch.no_grad():  # the biases are read: without them, other tokens
        for name, p in bundle.model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    assert Engine(bundle, runner).run(TRACE).outputs != expected


def test_biases_are_refused_where_they_are_not_supported(tmp_path: Path) -> None:
    from graphrunner_ref.model.parallel import TensorParallel, local_config
    from graphrunner_ref.model.quantize import quantize_model

    _save(tmp_path, attention_bias=True)
    config = read_config(tmp_path)
    with pytest.raises(ValueError, match="attention_bias=True, mlp_bias=False: biases are not"):
        local_config(config, TensorParallel(0, 2))
    bundle = load_model(tmp_path, max_requests=1, max_context_len=16)
    with pytest.raises(ValueError, match="quantize='fp16': the compact linears take no biases"):
        quantize_model(bundle.model, "fp16")
