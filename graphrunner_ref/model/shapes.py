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

__all__ = [
    "check_llama_weights",
    "check_weight_shapes",
    "llama_weight_shapes",
    "projection_shapes",
]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each layer's projections, by transformers module name under the layer
    (``self_attn.q_proj``), in the order they run: ``(out, in)``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "self_attn.q_proj": (q, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    biased = {"self_attn": config.attention_bias, "mlp": config.mlp_bias}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (out, inp) in projection_shapes(config).items():
        shapes[f"{name}.weight"] = (out, inp)
        if biased[name.split(".")[0]]:
            shapes[f"{name}.bias"] = (out,)
    hidden = config.hidden_size
    return shapes | {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }


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
