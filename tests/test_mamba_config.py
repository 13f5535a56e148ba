"""Mamba, Mamba-2, Jamba and Bamba configs: what is read, and what is refused
(naming the field) before anything is allocated."""

from __future__ import annotations

from typing import Any

import pytest

from graphrunner_ref.io.mamba_checkpoint import parse_config, state_space_type
from graphrunner_ref.model.config import CheckpointError, UnsupportedConfigError
from graphrunner_ref.model.hybrid_config import HybridConfig
from graphrunner_ref.model.mamba import MambaConfig
from graphrunner_ref.model.mamba2_mixer import Mamba2Shape

MAMBA = {"model_type": "mamba", "vocab_size": 256, "hidden_size": 32, "num_hidden_layers": 2}
JAMBA = {
    "model_type": "jamba",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "num_experts": 1,
}
BAMBA = {**JAMBA, "model_type": "bamba", "attn_layer_indices": [1], "mamba_n_heads": 8}


def test_each_kind_is_recognised_and_read() -> None:
    assert [state_space_type(c) for c in (MAMBA, JAMBA, BAMBA, {"model_type": "llama"})] == [
        "mamba",
        "jamba",
        "bamba",
        None,
    ]
    assert state_space_type({"architectures": ["Mamba2ForCausalLM"]}) == "mamba2"
    mamba = parse_config(dict(MAMBA))
    assert isinstance(mamba, MambaConfig) and mamba.mixer.intermediate_size == 64
    assert mamba.mixer.time_step_rank == 2  # "auto": ceil(hidden / 16)
    jamba = parse_config(dict(JAMBA))
    assert isinstance(jamba, HybridConfig) and jamba.attention_layers == (1, 3)
    assert jamba.mamba_layers == (0, 2) and jamba.rotary_dim == 0
    bamba = parse_config(dict(BAMBA))
    assert isinstance(bamba, HybridConfig) and isinstance(bamba.mixer, Mamba2Shape)
    assert bamba.attention_layers == (1,) and bamba.rotary_dim == 4  # half of head_dim 8
    assert bamba.mixer.head_dim == 8


@pytest.mark.parametrize(
    "config, match",
    [
        ({**MAMBA, "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({**MAMBA, "hidden_size": 0}, "hidden_size=0"),
        ({**MAMBA, "state_size": 2.5}, "state_size=2.5"),
        (
            {
                **MAMBA,
                "model_type": "mamba2",
                "num_heads": 8,
                "head_dim": 8,
                "time_step_limit": [0.0, 1.0],
            },
            "time_step_limit",
        ),  # fmt: skip
        ({**JAMBA, "num_experts": 2}, "num_experts=2"),
        ({**JAMBA, "attn_layer_period": 1, "attn_layer_offset": 0}, "4 attention layers"),
        ({**BAMBA, "attn_layer_indices": []}, "0 attention layers"),
        ({**BAMBA, "attention_bias": True}, "attention_bias=True"),
        ({**BAMBA, "rope_parameters": {"rope_type": "yarn"}}, "default rope"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(
    config: dict[str, Any], match: str
) -> None:
    with pytest.raises(UnsupportedConfigError, match=match):
        parse_config(config)


def test_a_config_of_another_model_is_refused() -> None:
    with pytest.raises(CheckpointError, match="model_type='llama'"):
        parse_config({"model_type": "llama"})
