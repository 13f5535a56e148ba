"""Build and load models with Mamba layers (``MambaForCausalLM``,
``JambaForCausalLM`` checkpoints) over a hybrid request pool.

:func:`state_space_type` says whether a ``config.json`` is one of them (the
checkpoint loader dispatches on it); :func:`load_state_space_model` reads the
checkpoint and returns a :class:`StateSpaceBundle`, which the engine serves
like a Llama bundle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphrunner import KVCache, MambaStatePool, TokenToKVPoolAllocator
from graphrunner.pools import HybridReqToTokenPool, whole_pages
from graphrunner_ref.model.build import PooledBundle
from graphrunner_ref.model.config import CheckpointError
from graphrunner_ref.model.hybrid import HybridLM
from graphrunner_ref.model.hybrid_config import HybridConfig
from graphrunner_ref.model.mamba import MambaConfig, MambaLM
from graphrunner_ref.model.weights import WeightError, check_weight_shapes, copy_checked_weights

__all__ = [
    "StateSpaceBundle",
    "build_state_space_model",
    "copy_weights",
    "load_state_space_model",
    "parse_config",
    "state_space_type",
]

#: model_type / architecture of each supported checkpoint kind.
_KINDS = {
    "mamba": "MambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "jamba": "JambaForCausalLM",
    "bamba": "BambaForCausalLM",
}


def state_space_type(hf: Mapping[str, Any]) -> str | None:
    """``"mamba"``, ``"mamba2"``, ``"jamba"`` or ``"bamba"`` when ``config.json``
    ``hf`` is such a model, else None."""
    archs = hf.get("architectures") or []
    for kind, arch in _KINDS.items():
        if hf.get("model_type") == kind or (isinstance(archs, list) and arch in archs):
            return kind
    return None


@dataclass(frozen=True, slots=True)
class StateSpaceBundle(PooledBundle):
    """A Mamba or hybrid model and the pools it was built over.

    ``req_pool`` is a :class:`HybridReqToTokenPool` (``req_to_token`` int32
    ``[max_requests + 1, max_context_len]``, one Mamba slot per row);
    ``kv_alloc`` hands out KV pages (the engine's bookkeeping; only a hybrid
    model has a ``kv_cache`` to store them in).
    """

    model: MambaLM | HybridLM
    req_pool: HybridReqToTokenPool
    kv_alloc: TokenToKVPoolAllocator
    kv_cache: KVCache | None

    @property
    def config(self) -> MambaConfig | HybridConfig:
        return self.model.config

    @property
    def mamba_pool(self) -> MambaStatePool:
        return self.req_pool.mamba_pool


def build_state_space_model(
    config: MambaConfig | HybridConfig,
    *,
    max_requests: int,
    max_context_len: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
    track_buffers: bool = False,
) -> StateSpaceBundle:
    """Pools sized for ``max_requests`` requests of ``max_context_len`` tokens,
    and an (uninitialised) model over them. The Mamba pool has one slot per
    request row (three with ``track_buffers``)."""
    slots = max_requests * whole_pages(max_context_len, page_size)
    kv_alloc = TokenToKVPoolAllocator(slots, device, page_size=page_size)
    mixer = config.mixer
    layers = config.num_layers if isinstance(config, MambaConfig) else len(config.mamba_layers)
    mamba_pool = MambaStatePool(
        max_requests * (3 if track_buffers else 1),
        (layers, *mixer.conv_state_shape),
        (layers, *mixer.ssm_state_shape),
        dtype,
        device,
    )
    req_pool = HybridReqToTokenPool(
        max_requests, max_context_len, device, mamba_pool, track_buffers=track_buffers
    )
    if isinstance(config, MambaConfig):
        return StateSpaceBundle(MambaLM(config, req_pool, dtype=dtype), req_pool, kv_alloc, None)
    a = config.attention
    kv_cache = KVCache(
        slots, len(config.attention_layers), a.num_kv_heads, a.head_dim, dtype, device, page_size
    )
    model = HybridLM(config, req_pool, kv_cache, dtype=dtype)
    return StateSpaceBundle(model, req_pool, kv_alloc, kv_cache)


def parse_config(hf: dict[str, Any]) -> MambaConfig | HybridConfig:
    """The config of a ``mamba`` or ``jamba`` ``config.json``."""
    kind = state_space_type(hf)
    if kind in ("mamba", "mamba2"):
        return MambaConfig.from_hf_dict(hf)
    if kind in ("jamba", "bamba"):
        return HybridConfig.from_hf_dict(hf)
    raise CheckpointError(
        f"config is not a Mamba or Jamba model: model_type={hf.get('model_type')!r}"
    )


@torch.no_grad()
def copy_weights(
    model: nn.Module, weights: Mapping[str, torch.Tensor], *, tied: str | None
) -> None:
    """Copy a transformers-named state dict into ``model``, cast to each
    parameter's dtype; all checked before any copy. ``tied``: the embedding
    name that ``lm_head.weight`` ties to (a saved copy of it is dropped).

    Raises :class:`WeightError` naming the first missing, unexpected or misshapen tensor.
    """
    given = dict(weights)
    head = given.pop("lm_head.weight", None) if tied is not None else None
    if tied is not None and head is not None and not torch.equal(head, given.get(tied, head[:0])):
        raise WeightError(f"unexpected tensor 'lm_head.weight': it differs from the tied {tied}")
    copy_checked_weights(model, given)


def load_weights(bundle: StateSpaceBundle, weights: Mapping[str, torch.Tensor]) -> None:
    """Load ``weights`` into the bundle's model (tied heads by its config)."""
    model = bundle.model
    if isinstance(model, MambaLM):
        tied = "backbone.embeddings.weight" if model.lm_head is None else None
    else:
        tied = "model.embed_tokens.weight" if model.lm_head is None else None
    copy_weights(model, weights, tied=tied)


def _check_shapes_first(
    config: MambaConfig | HybridConfig,
    weights: Mapping[str, torch.Tensor],
    context: int,
    page_size: int,
    where: str,
) -> None:
    """Every weight's name and shape against the model of ``config``, built on
    the ``meta`` device (shapes, no memory) before the real one is allocated:
    a config that claims a vocabulary of 10**9 over a small file is refused
    here, not by the allocator."""
    with torch.device("meta"):
        shadow = build_state_space_model(
            config, max_requests=1, max_context_len=context, device="meta", page_size=page_size
        )
    model = shadow.model
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    given = {name: tuple(w.shape) for name, w in weights.items()}
    if model.lm_head is None:  # tied: a saved copy of the head is compared at load
        given.pop("lm_head.weight", None)
    check_weight_shapes(given, expected, where)


#: Context when none is given: a Mamba checkpoint states no maximum.
DEFAULT_CONTEXT = 2048


def load_state_space_model(
    hf: dict[str, Any],
    weights: Mapping[str, torch.Tensor],
    *,
    max_requests: int,
    max_context_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
    track_buffers: bool = False,
    where: str = "checkpoint",
) -> StateSpaceBundle:
    """Build the model of ``config.json`` ``hf`` over fresh pools (see
    :func:`build_state_space_model`) and load ``weights`` (read by
    :func:`graphrunner_ref.io.checkpoint.read_weights`) into it. ``where`` (the
    checkpoint's folder) starts the error of a weight that does not fit."""
    config = parse_config(hf)
    context = DEFAULT_CONTEXT if max_context_len is None else max_context_len
    if isinstance(config, HybridConfig):
        context = min(context, config.attention.max_position_embeddings)
    _check_shapes_first(config, weights, context, page_size, where)
    bundle = build_state_space_model(
        config,
        max_requests=max_requests,
        max_context_len=context,
        device=device,
        dtype=dtype,
        page_size=page_size,
        track_buffers=track_buffers,
    )
    load_weights(bundle, weights)
    return bundle
