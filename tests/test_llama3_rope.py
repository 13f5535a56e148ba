"""Llama 3.1's RoPE scaling in the native model: a tiny random Llama with
``rope_type: llama3`` saved by transformers loads natively (``auto`` picks the
native model) and its padded greedy decode equals transformers' ``generate``
token for token; the scaled frequencies equal transformers' own."""

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


def _save(path: Path) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.1, rope_parameters={**LLAMA3, "rope_theta": 500000.0},
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
