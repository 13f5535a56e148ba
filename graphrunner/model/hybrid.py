"""A hybrid of attention and Mamba-1 layers: the reference executor of a
``JambaForCausalLM`` checkpoint (dense layers: ``num_experts`` 1).

Attention layers (no rotary embedding, as in Jamba) read and write the paged
KV pool through ``req_to_token``; Mamba layers (the mixer of
:mod:`graphrunner.model.mamba_mixer`, with Jamba's dt/B/C norms) keep their
state in the request's Mamba slot. One :class:`~graphrunner.pools.
HybridReqToTokenPool` maps each request row to both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.inputs import StepInputs
from graphrunner.model.attention import AttnMetadata, KVStore, PagedAttention, TorchPagedBackend
from graphrunner.model.config import ModelConfig, UnsupportedConfigError
from graphrunner.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from graphrunner.model.mamba import MambaStepInputs, _int
from graphrunner.model.mamba_mixer import MambaMixer, MixerShape, gather_states, write_states
from graphrunner.pools.hybrid import HybridReqToTokenPool
from graphrunner.state_ops import run_state_ops

__all__ = ["HybridConfig", "HybridLM"]


class HybridStepInputs(StepInputs, MambaStepInputs):
    """A decode step of a hybrid model: the KV fields and the Mamba fields."""


@dataclass(frozen=True, slots=True)
class HybridConfig:
    """A Jamba-style stack: ``attention`` (the attention layers' shape) plus
    which layers are attention (the others are Mamba) and the mixer shape."""

    attention: ModelConfig
    mixer: MixerShape
    attention_layers: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return self.attention.num_layers

    @property
    def vocab_size(self) -> int:
        return self.attention.vocab_size

    @property
    def mamba_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.attention_layers)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> HybridConfig:
        """From a ``JambaForCausalLM`` ``config.json``; refuses MoE layers."""
        layers = _int(hf, "num_hidden_layers")
        period, offset = _int(hf, "attn_layer_period", 8), hf.get("attn_layer_offset", 4)
        experts = hf.get("num_experts", 1)
        if experts != 1:
            raise UnsupportedConfigError(
                f"config field num_experts={experts!r}; expected 1 (dense)"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedConfigError(
                f"config field hidden_act={hf['hidden_act']!r}; expected 'silu'"
            )
        hidden = _int(hf, "hidden_size")
        rank = hf.get("mamba_dt_rank", "auto")
        eps = float(hf.get("rms_norm_eps", 1e-6))
        attention = ModelConfig(
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(hf, "intermediate_size"),
            num_layers=layers,
            num_heads=_int(hf, "num_attention_heads"),
            num_kv_heads=_int(hf, "num_key_value_heads", hf.get("num_attention_heads")),
            rms_norm_eps=eps,
            max_position_embeddings=_int(hf, "max_position_embeddings", 262144),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
        mixer = MixerShape(
            hidden_size=hidden,
            intermediate_size=_int(hf, "mamba_expand", 2) * hidden,
            state_size=_int(hf, "mamba_d_state", 16),
            conv_kernel=_int(hf, "mamba_d_conv", 4),
            time_step_rank=-(-hidden // 16) if rank == "auto" else _int(hf, "mamba_dt_rank"),
            conv_bias=bool(hf.get("mamba_conv_bias", True)),
            proj_bias=bool(hf.get("mamba_proj_bias", False)),
            bcdt_norm_eps=eps,
        )
        attn = tuple(i for i in range(layers) if i % period == offset)
        if not attn or len(attn) == layers:
            raise UnsupportedConfigError(
                f"attn_layer_period={period}, attn_layer_offset={offset} over {layers} layers "
                f"give {len(attn)} attention layers; expected a mix of attention and Mamba layers"
            )
        return cls(attention, mixer, attn)


class _NoRotary(RotaryEmbedding):
    """Jamba's attention has no positional embedding: q and k pass unchanged."""

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class _LayerKV:
    """The KV pool seen by attention layer ``i`` of the stack: its own KV layer."""

    def __init__(self, kv: KVStore, index: dict[int, int]) -> None:
        self.kv, self.index = kv, index

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv.set_kv(self.index[layer], loc, k, v)

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.get_kv(self.index[layer])


class HybridLayer(nn.Module):
    """``h + mixer(norm(h))`` then ``h + ffn(norm(h))``; the mixer is
    ``self_attn`` or ``mamba`` (transformers' names)."""

    def __init__(self, config: HybridConfig, i: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config.attention
        self.self_attn: PagedAttention | None = None
        self.mamba: MambaMixer | None = None
        if i in config.attention_layers:
            self.self_attn = PagedAttention(c, i, dtype=dtype)
        else:
            self.mamba = MambaMixer(config.mixer, dtype=dtype)
        self.feed_forward = SwiGLUMLP(c.hidden_size, c.intermediate_size, dtype=dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)


class HybridBody(nn.Module):
    def __init__(self, config: HybridConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c = config.attention
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.blocks = [HybridLayer(config, i, dtype) for i in range(c.num_layers)]
        self.layers = nn.ModuleList(self.blocks)
        self.final_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)


class HybridLM(nn.Module):
    """Attention + Mamba-1 LM; parameter names match ``JambaForCausalLM``.

    Args:
        config: the stack.
        req_pool: the hybrid request pool; its Mamba pool holds, per slot,
            conv ``[mamba layers, intermediate, K]`` and ssm ``[mamba layers, intermediate, S]``.
        kv_cache: a KV pool with one layer per attention layer.
        dtype: parameter and activation dtype; logits are float32.
    """

    def __init__(
        self,
        config: HybridConfig,
        req_pool: HybridReqToTokenPool,
        kv_cache: KVStore,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        pool = req_pool.mamba_pool
        n = len(config.mamba_layers)
        want = ((n, *config.mixer.conv_state_shape), (n, *config.mixer.ssm_state_shape))
        if (pool.conv_shape, pool.ssm_shape) != want:
            raise ValueError(
                f"mamba pool state shapes {pool.conv_shape} / {pool.ssm_shape}: expected "
                f"{want[0]} / {want[1]} for this config"
            )
        self.config = config
        self.req_pool = req_pool
        self.kv = _LayerKV(kv_cache, {j: i for i, j in enumerate(config.attention_layers)})
        self.attn_backend = TorchPagedBackend(req_pool.req_to_token)
        self.model = HybridBody(config, dtype)
        c = config.attention
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        )
        self.rotary = _NoRotary()
        self.to(pool.device).requires_grad_(False)

    def forward_decode(self, inputs: HybridStepInputs) -> torch.Tensor:
        """One decode step: logits float32 ``[bs, vocab]``. Writes each row's K/V
        at ``out_cache_loc`` and advances each masked row's Mamba state."""
        pool = self.req_pool.mamba_pool
        slots, mask = inputs.mamba_track_indices, inputs.mamba_track_mask
        conv, ssm = gather_states(pool, slots)
        meta = self.attn_backend.decode_metadata(inputs, self.config.attention.num_kv_groups)
        h = self.model.embed_tokens(inputs.input_ids)
        new_conv: list[torch.Tensor] = []
        new_ssm: list[torch.Tensor] = []
        for layer in self.model.blocks:
            x = layer.input_layernorm(h)
            if layer.mamba is None:
                assert layer.self_attn is not None
                out = layer.self_attn(
                    x, inputs.positions, inputs.out_cache_loc, self.kv, meta, self.rotary
                )
            else:
                j = len(new_conv)
                out, c, s = layer.mamba.step(x, conv[:, j], ssm[:, j])
                new_conv.append(c)
                new_ssm.append(s)
            h = h + out
            h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
        write_states(
            pool, slots, mask, (torch.stack(new_conv, 1), torch.stack(new_ssm, 1)), (conv, ssm)
        )
        return self.logits(self.model.final_layernorm(h))

    @torch.no_grad()
    def forward_extend(
        self, req_pool_index: int, token_ids: torch.Tensor, kv_slots: torch.Tensor
    ) -> torch.Tensor:
        """Eager prefill of one request from empty Mamba state and no cached
        prefix: logits float32 ``[vocab]`` of its last token. Runs recorded
        state ops first; records ``kv_slots`` in ``req_to_token``."""
        n = token_ids.shape[0]
        backend = self.attn_backend
        if n < 1 or kv_slots.shape != token_ids.shape or n > backend.max_context_len:
            raise ValueError(
                f"forward_extend: token_ids {tuple(token_ids.shape)} and kv_slots "
                f"{tuple(kv_slots.shape)}: expected the same [n], 1 <= n <= "
                f"max_context_len={backend.max_context_len}"
            )
        slot = self.req_pool.mamba_slots([req_pool_index])[0]
        if slot == 0:
            raise ValueError(f"forward_extend: req_pool_index={req_pool_index} owns no Mamba slot")
        run_state_ops(self.req_pool)
        backend.req_to_token[req_pool_index, :n] = kv_slots
        positions = torch.arange(n, device=token_ids.device)
        group = self.config.attention.num_kv_groups
        meta = backend.extend_metadata(req_pool_index, positions, n, group)
        return self.logits(self._prefill(token_ids, positions, kv_slots, meta, slot)[-1])

    def _prefill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv_slots: torch.Tensor,
        meta: AttnMetadata,
        slot: int,
    ) -> torch.Tensor:
        pool = self.req_pool.mamba_pool
        h = self.model.embed_tokens(ids)
        j = 0
        for layer in self.model.blocks:
            x = layer.input_layernorm(h)
            if layer.mamba is None:
                assert layer.self_attn is not None
                out = layer.self_attn(x, positions, kv_slots, self.kv, meta, self.rotary)
            else:
                out, conv, ssm = layer.mamba.prefill(x)
                pool.conv_state[slot, j] = conv
                pool.ssm_state[slot, j] = ssm
                j += 1
            h = h + out
            h = h + layer.feed_forward(layer.pre_ff_layernorm(h))
        return self.model.final_layernorm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(h, head.weight).float()
