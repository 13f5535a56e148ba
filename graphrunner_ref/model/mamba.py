"""A Mamba-1 language model over a slot pool: the reference executor of a
``MambaForCausalLM`` checkpoint.

Each request row of a :class:`~graphrunner.pools.HybridReqToTokenPool` owns a
Mamba slot holding every layer's conv window and SSM state. A decode step
reads ``mamba_track_indices`` (each row's slot, 0 on padded rows) and
``mamba_track_mask`` (False on padded rows, whose update is discarded), so the
same forward serves every runner and padded rows never change a slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner import BufferView
from graphrunner.declare import run_state_ops
from graphrunner.pools import HybridReqToTokenPool
from graphrunner_ref.model.config import UnsupportedConfigError
from graphrunner_ref.model.layers import RMSNorm
from graphrunner_ref.model.mamba2_mixer import Mamba2Mixer, Mamba2Shape
from graphrunner_ref.model.mamba_mixer import MambaMixer, MixerShape, gather_states, write_states

__all__ = ["MambaConfig", "MambaLM"]


def config_int(hf: dict[str, Any], name: str, default: int | None = None) -> int:
    """Field ``name`` of ``config.json`` ``hf`` (``default`` when absent), a positive
    int, or :class:`UnsupportedConfigError` naming the field and its value."""
    value = hf.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedConfigError(f"config field {name}={value!r}: expected a positive int")
    return value


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """Shape of a Mamba LM (transformers' ``MambaConfig`` / ``Mamba2Config``
    fields that matter): Mamba-1 with a :class:`MixerShape`, Mamba-2 with a
    :class:`Mamba2Shape`."""

    vocab_size: int
    num_layers: int
    mixer: MixerShape | Mamba2Shape
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = True

    @property
    def hidden_size(self) -> int:
        return self.mixer.hidden_size

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> MambaConfig:
        """From a ``MambaForCausalLM`` ``config.json``; refuses what it cannot run."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedConfigError(f"config field hidden_act={act!r}; expected 'silu'")
        if hf.get("model_type") == "mamba2" or "Mamba2ForCausalLM" in (
            hf.get("architectures") or []
        ):
            return cls._from_mamba2(hf)
        hidden = config_int(hf, "hidden_size")
        inner = hf.get("intermediate_size") or config_int(hf, "expand", 2) * hidden
        rank = hf.get("time_step_rank", "auto")
        rank = -(-hidden // 16) if rank == "auto" else rank
        mixer = MixerShape(
            hidden_size=hidden,
            intermediate_size=config_int({"intermediate_size": inner}, "intermediate_size"),
            state_size=config_int(hf, "state_size", 16),
            conv_kernel=config_int(hf, "conv_kernel", 4),
            time_step_rank=config_int({"time_step_rank": rank}, "time_step_rank"),
            conv_bias=bool(hf.get("use_conv_bias", True)),
            proj_bias=bool(hf.get("use_bias", False)),
        )
        return cls(
            vocab_size=config_int(hf, "vocab_size"),
            num_layers=config_int(hf, "num_hidden_layers"),
            mixer=mixer,
            layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )

    @classmethod
    def _from_mamba2(cls, hf: dict[str, Any]) -> MambaConfig:
        limit = hf.get("time_step_limit", [0.0, None])
        if not isinstance(limit, list) or limit[:1] != [0.0] or not is_unbounded(limit[1:]):
            raise UnsupportedConfigError(
                f"config field time_step_limit={limit!r}; expected [0.0, Infinity]"
            )
        hidden = config_int(hf, "hidden_size")
        eps = float(hf.get("layer_norm_epsilon", 1e-5))
        mixer = Mamba2Shape(
            hidden_size=hidden,
            intermediate_size=config_int(hf, "expand", 2) * hidden,
            state_size=config_int(hf, "state_size", 128),
            conv_kernel=config_int(hf, "conv_kernel", 4),
            num_heads=config_int(hf, "num_heads"),
            head_dim=config_int(hf, "head_dim"),
            n_groups=config_int(hf, "n_groups", 1),
            norm_eps=eps,
            conv_bias=bool(hf.get("use_conv_bias", True)),
            proj_bias=bool(hf.get("use_bias", False)),
        )
        return cls(
            vocab_size=config_int(hf, "vocab_size"),
            num_layers=config_int(hf, "num_hidden_layers"),
            mixer=mixer,
            layer_norm_epsilon=eps,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


def is_unbounded(rest: list[Any]) -> bool:
    """transformers writes an infinite upper limit as ``{"__float__": "Infinity"}``."""
    if not rest:
        return True
    top = rest[0]
    return top is None or top == float("inf") or top == {"__float__": "Infinity"}


class MambaBlock(nn.Module):
    def __init__(self, config: MambaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)
        shape = config.mixer
        self.mixer: MambaMixer | Mamba2Mixer = (
            MambaMixer(shape, dtype=dtype)
            if isinstance(shape, MixerShape)
            else Mamba2Mixer(shape, dtype=dtype)
        )


class MambaBackbone(nn.Module):
    def __init__(self, config: MambaConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.blocks = [MambaBlock(config, dtype) for _ in range(config.num_layers)]
        self.layers = nn.ModuleList(self.blocks)
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, dtype=dtype)


class MambaLM(nn.Module):
    """Mamba-1 LM; parameter names match ``MambaForCausalLM``
    (``backbone.layers.0.mixer.in_proj.weight``...).

    Args:
        config: the model shape.
        req_pool: the hybrid request pool; its Mamba pool holds, per slot,
            conv ``[num_layers, intermediate, conv_kernel]`` and ssm
            ``[num_layers, intermediate, state_size]``.
        dtype: parameter and activation dtype; logits are float32.
    """

    def __init__(
        self, config: MambaConfig, req_pool: HybridReqToTokenPool, *, dtype: torch.dtype
    ) -> None:
        super().__init__()
        pool = req_pool.mamba_pool
        want = (config.num_layers, *config.mixer.conv_state_shape)
        want_ssm = (config.num_layers, *config.mixer.ssm_state_shape)
        if pool.conv_shape != want or pool.ssm_shape != want_ssm:
            raise ValueError(
                f"mamba pool state shapes {pool.conv_shape} / {pool.ssm_shape}: expected "
                f"{want} / {want_ssm} for this config"
            )
        self.config = config
        self.req_pool = req_pool
        self.backbone = MambaBackbone(config, dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        )
        self.to(pool.device).requires_grad_(False)

    def forward_decode(self, inputs: BufferView) -> torch.Tensor:
        """One decode step: logits float32 ``[bs, vocab]``; advances each masked
        row's state in its slot. Static shapes, no host reads: capturable."""
        pool = self.req_pool.mamba_pool
        slots, mask = inputs.mamba_track_indices, inputs.mamba_track_mask
        conv, ssm = gather_states(pool, slots)
        h = self.backbone.embeddings(inputs.input_ids)
        new_conv, new_ssm = [], []
        for i, layer in enumerate(self.backbone.blocks):
            out, c, s = layer.mixer.step(layer.norm(h), conv[:, i], ssm[:, i])
            h = h + out
            new_conv.append(c)
            new_ssm.append(s)
        write_states(
            pool, slots, mask, (torch.stack(new_conv, 1), torch.stack(new_ssm, 1)), (conv, ssm)
        )
        return self.logits(self.backbone.norm_f(h))

    @torch.no_grad()
    def forward_extend(
        self, req_pool_index: int, token_ids: torch.Tensor, kv_slots: torch.Tensor
    ) -> torch.Tensor:
        """Eager prefill of one request from an empty state: logits float32
        ``[vocab]`` of its last token; stores the final state in its slot.

        Recorded state ops run first (this forward is a step too), so a clear
        recorded for the new slot cannot wipe the state stored here.
        ``kv_slots`` (int64 ``[n]``) are recorded in ``req_to_token`` as the
        engine's bookkeeping expects; no KV is written.
        """
        n = token_ids.shape[0]
        if n < 1 or kv_slots.shape != token_ids.shape:
            raise ValueError(
                f"forward_extend: token_ids {tuple(token_ids.shape)} and kv_slots "
                f"{tuple(kv_slots.shape)}: expected the same non-empty [n]"
            )
        slot = self.req_pool.mamba_slots([req_pool_index])[0]
        if slot == 0:
            raise ValueError(f"forward_extend: req_pool_index={req_pool_index} owns no Mamba slot")
        run_state_ops(self.req_pool)
        self.req_pool.req_to_token[req_pool_index, :n] = kv_slots
        pool = self.req_pool.mamba_pool
        h = self.backbone.embeddings(token_ids)
        for i, layer in enumerate(self.backbone.blocks):
            out, conv, ssm = layer.mixer.prefill(layer.norm(h))
            h = h + out
            pool.conv_state[slot, i] = conv
            pool.ssm_state[slot, i] = ssm
        return self.logits(self.backbone.norm_f(h[-1]))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.backbone.embeddings if self.lm_head is None else self.lm_head
        return F.linear(h, head.weight).float()
