"""The tensors a Llama checkpoint must hold, by transformers name and shape,
known from the config alone: nothing the size of the model is allocated.

The per-layer table restates :class:`~graphrunner_ref.model.llama.LlamaDecoderLayer`'s
parameters (building one, even on the ``meta`` device, would cost seconds of
imports or the memory of a layer); ``tests/test_gguf_hostile.py`` keeps the two
equal. A config that claims a million layers is refused by
:func:`check_llama_weights` from the layers the file holds, before the
table is expanded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.weights import WeightError, check_weight_shapes, layer_order

__all__ = ["check_llama_weights", "check_weight_shapes", "llama_weight_shapes"]


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if config.attention_bias:
        shapes |= {
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
            "self_attn.o_proj.bias": (hidden,),
        }
    if config.mlp_bias:
        shapes |= {
            "mlp.gate_proj.bias": (inter,),
            "mlp.up_proj.bias": (inter,),
            "mlp.down_proj.bias": (hidden,),
        }
    return shapes


def llama_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a ``LlamaForCausalLM`` of ``config``: name -> shape."""
    per_layer = _layer_shapes(config)
    vocab, hidden = config.vocab_size, config.hidden_size
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(config.num_layers):
        shapes.update({f"model.layers.{i}.{n}": s for n, s in per_layer.items()})
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def check_llama_weights(
    given: Mapping[str, Sequence[int]], config: ModelConfig, where: str
) -> None:
    """``given`` (name -> shape) against a Llama of ``config``; :class:`WeightError`
    naming the first tensor missing, unexpected or misshapen. Layers the
    config claims and the file lacks are counted first, in the time the
    file's own names take."""
    present = {layer_order(name)[0] for name in given}
    first = 0
    while first in present:
        first += 1
    if first < config.num_layers:
        missing = config.num_layers - len(present.intersection(range(config.num_layers)))
        name = next(iter(_layer_shapes(config)))
        raise WeightError(
            f"{where}: missing tensor 'model.layers.{first}.{name}' ({missing} of "
            f"{config.num_layers} layers missing)"
        )
    check_weight_shapes(given, llama_weight_shapes(config), where)
