"""The attention layers of a transformers decoder, found by how transformers
calls them, not by their names.

A decoder's attention modules are whatever goes through transformers'
attention interface (``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``).
:func:`find_attention` runs the model once on one token with a probe
registered under :data:`PROBE` as its attention: each call records its module
and the shapes of its key and value (``[1, KVH, T, D]``), and returns zeros
in the output's shape (``[1, T, H, Dv]``) so the forward runs to its end. The
modules, in the order the forward calls them, are the KV layers; their key
shapes are the KV cache's heads and head size. A module's class name, its
projection names (``o_proj``, ``dense``, ``c_proj``) and the config's keys
play no part.

The probe runs twice, at positions 0 and 1: a model whose queries are the
same at both takes its positions from the sequence's length rather than
from ``position_ids`` (BART-style decoders), and the bridge, which runs a
step's rows as one sequence each at its own position, cannot place its
rows. A model whose own cache (transformers' ``DynamicCache`` for its
config) keeps recurrent state beside the KV (linear attention, Mamba
mixers) is refused too: the bridge keeps only K and V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphrunner.util import needs_extra

__all__ = ["LONG_PROBE", "PROBE", "UNHONOURED", "AttentionLayers", "find_attention"]

#: The name the probe registers with transformers' attention (and mask) interfaces.
PROBE = "graphrunner_probe"
#: Attention arguments that change the result and that the bridge's attention
#: does not apply (sinks passed by another name, a relative position bias,
#: sparse indices): a layer that passes one is refused rather than answered
#: wrongly. (``s_aux``, GPT-OSS's attention sinks, it applies.)
UNHONOURED = ("sinks", "position_bias", "indices", "block_indices", "head_mask")
#: Tokens of the probe that looks for K/V a layer makes of its own (more than
#: a compression window of the models that compress, such as 128).
LONG_PROBE = 160


@dataclass(frozen=True, slots=True)
class AttentionLayers:
    """A decoder's attention modules in the order one forward calls them
    (KV layer ``i`` is ``modules[i]``), and the K/V shape every one of them
    passes: ``kv_heads`` heads of ``head_dim``."""

    modules: tuple[nn.Module, ...]
    kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class _Call:
    module: nn.Module
    #: The query the module passed (to see whether the position reached it).
    query: torch.Tensor
    key: tuple[int, ...]
    value: tuple[int, ...]
    #: What the layer passes that the bridge would not apply.
    unhonoured: tuple[str, ...]


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        passed = [k for k in UNHONOURED if kwargs.get(k) is not None]
        if attention_mask is not None:  # built by the model itself, not the mask interface
            passed.append("attention_mask")
        call = _Call(
            module, query.detach().clone(), tuple(key.shape), tuple(value.shape), tuple(passed)
        )
        self.calls.append(call)
        b, heads, t, _ = query.shape
        return query.new_zeros(b, t, heads, value.shape[-1]), None


_RECORDER = _Recorder()


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def _register() -> None:
    with needs_extra("text", "the transformers bridge"):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE, _RECORDER)
    AttentionMaskInterface.register(PROBE, _no_mask)


def find_attention(hf: nn.Module) -> AttentionLayers:
    """The attention layers of ``hf`` (a ``*ForCausalLM``), found by one probe
    forward of one token; its attention implementation is left as it was.

    Raises:
        ValueError: one line naming the reason: no module calls transformers'
            attention interface, or fewer than the config's layers do (the
            others keep state the bridge does not), a layer passes what the
            bridge's attention does not apply (:data:`UNHONOURED`, a mask of
            its own), a module is called twice in one forward, the layers'
            K/V shapes differ, or keys and values differ in head size.
    """
    name = type(hf).__name__
    if not callable(getattr(hf, "set_attn_implementation", None)):
        raise ValueError(
            f"{name}: not a transformers model (no set_attn_implementation); the "
            "transformers bridge runs a transformers *ForCausalLM"
        )
    _register()
    config: Any = hf.config
    calls, moved = _probe(hf, 0), _probe(hf, 1)
    if not calls:
        raise ValueError(
            f"{name}: no module calls transformers' attention interface; the transformers "
            "bridge runs decoders whose attention goes through it"
        )
    unhonoured = sorted({k for c in calls for k in c.unhonoured})
    if unhonoured:
        raise ValueError(
            f"{name}: its attention layers pass {', '.join(unhonoured)}, which the "
            "transformers bridge's attention does not apply (it masks by each row's length "
            "and window, with scaling and soft-capping)"
        )
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int) and len(calls) < layers:
        raise ValueError(
            f"{name}: {len(calls)} of its {layers} layers call transformers' attention "
            "interface; the others (linear attention or recurrent state) keep state the "
            "transformers bridge does not"
        )
    recurrent = _recurrent_cache_layers(hf)
    if recurrent:
        raise ValueError(
            f"{name}: its cache keeps recurrent state beside K and V ({', '.join(recurrent)}); "
            "the transformers bridge keeps only K and V"
        )
    modules = [c.module for c in calls]
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(
            f"{name}: an attention module is called more than once per forward; the "
            "transformers bridge keeps one KV layer per attention module"
        )
    shapes = {(c.key[1], c.key[3], c.value[1], c.value[3]) for c in calls}
    if len(shapes) != 1:
        raise ValueError(
            f"{name}: its attention layers pass K/V of different shapes (KV heads, key "
            f"size, value heads, value size: {sorted(shapes)}); the transformers bridge "
            "keeps one KV shape for every layer"
        )
    if len(moved) == len(calls) and all(
        a.query.shape == b.query.shape and torch.equal(a.query, b.query)
        for a, b in zip(calls, moved, strict=True)
    ):
        raise ValueError(
            f"{name}: its layers see the same query at positions 0 and 1 (positions taken "
            "from the sequence's length, not position_ids); the transformers bridge runs a "
            "step's rows as one sequence, each at the position_ids it passes"
        )
    _refuse_kv_of_its_own(hf, name)
    kv_heads, key_dim, v_heads, value_dim = shapes.pop()
    if (kv_heads, key_dim) != (v_heads, value_dim):
        raise ValueError(
            f"{name}: keys of {kv_heads} heads of {key_dim} and values of {v_heads} heads "
            f"of {value_dim}; the transformers bridge keeps keys and values of one shape"
        )
    return AttentionLayers(tuple(modules), kv_heads, key_dim)


def _refuse_kv_of_its_own(hf: nn.Module, name: str) -> None:
    """Refuse ``hf`` where a layer passes K/V for more (or fewer) positions
    than its query has tokens, seen on a prompt of :data:`LONG_PROBE` tokens:
    entries the layer makes itself, such as K/V compressed every so many
    tokens, which the bridge's one K/V slot per token cannot hold. A model
    that cannot take so long a prompt (learned positions, fewer of them) makes
    no such entries at those lengths either, and passes."""
    try:
        calls = _probe(hf, 0, LONG_PROBE)
    except ValueError:
        return
    odd = sorted({(c.query.shape[2], c.key[2]) for c in calls if c.key[2] != c.query.shape[2]})
    if odd:
        query_len, key_len = odd[0]
        raise ValueError(
            f"{name}: its attention layers pass K/V for {key_len} positions with a "
            f"{query_len}-token query (entries of their own, such as compressed K/V); the "
            "transformers bridge keeps one K/V per token"
        )


def _probe(hf: nn.Module, position: int, tokens: int = 1) -> list[_Call]:
    """The attention calls of one forward of ``hf`` on ``tokens`` tokens
    from ``position``, through the probe; the attention implementation restored."""
    name = type(hf).__name__
    before = getattr(hf.config, "_attn_implementation", None)
    param = next(hf.parameters())
    _RECORDER.calls.clear()
    try:
        hf.set_attn_implementation(PROBE)  # type: ignore[operator]
        ids = torch.ones(1, tokens, dtype=torch.long, device=param.device)
        positions = torch.arange(position, position + tokens, device=param.device)[None]
        with torch.no_grad():
            hf(input_ids=ids, position_ids=positions, use_cache=False)
    except Exception as e:  # whatever transformers raises, one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"{name}: a {_tokens(tokens)} forward failed ({type(e).__name__}: {first}); the "
            "transformers bridge finds the attention layers by calling the model"
        ) from None
    finally:
        calls = list(_RECORDER.calls)
        _RECORDER.calls.clear()
        if before is not None:
            hf.set_attn_implementation(before)  # type: ignore[operator]
    return calls


def _tokens(n: int) -> str:
    return "one-token" if n == 1 else f"{n}-token"


def _recurrent_cache_layers(hf: nn.Module) -> list[str]:
    """The classes of the layers of transformers' own cache for ``hf``'s
    config that keep recurrent state (linear attention, Mamba); empty where
    there are none or transformers builds no such cache for it."""
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

        cache = DynamicCache(config=hf.config)  # type: ignore[arg-type]
    except Exception:  # an older transformers, or a config it builds no cache from
        return []
    layers = getattr(cache, "layers", [])
    return sorted(
        {type(x).__name__ for x in layers if isinstance(x, LinearAttentionCacheLayerMixin)}
    )
