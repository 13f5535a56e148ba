"""A hybrid of attention and Mamba layers: the reference executor of a
``JambaForCausalLM`` (dense; Mamba-1 with dt/B/C norms, no rotary embedding)
or a ``BambaForCausalLM`` (Mamba-2; rotary embedding on the first half of
each attention head) checkpoint.

Attention layers read and write the paged KV pool through ``req_to_token``;
Mamba layers keep their state in the request's Mamba slot. One
:class:`~graphrunner.pools.HybridReqToTokenPool` maps each request row to both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner import BufferView
from graphrunner.declare import run_state_ops
from graphrunner.pools import HybridReqToTokenPool
from graphrunner_ref.model.attention import PagedAttention
from graphrunner_ref.model.attention_backend import TorchPagedBackend, device_attention
from graphrunner_ref.model.attention_meta import AttnMetadata, KVStore
from graphrunner_ref.model.hybrid_config import HybridConfig
from graphrunner_ref.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from graphrunner_ref.model.mamba2_mixer import Mamba2Mixer
from graphrunner_ref.model.mamba_mixer import MambaMixer, MixerShape, gather_states, write_states

__all__ = ["HybridConfig", "HybridLM"]


class _NoRotary(RotaryEmbedding):
    """Jamba's attention has no positional embedding: q and k pass unchanged."""

    table_rotation = False

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class _PartialRotary(RotaryEmbedding):
    """Rotary embedding on the first ``rotary_dim`` dims of each head (Bamba);
    the rest pass unchanged."""

    table_rotation = False

    def __init__(self, rotary_dim: int, max_positions: int, theta: float) -> None:
        super().__init__(rotary_dim, max_positions, theta)
        self.rotary_dim = rotary_dim

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        q_rot, k_rot = super().forward(positions, q[..., :r], k[..., :r])
        return torch.cat([q_rot, q[..., r:]], -1), torch.cat([k_rot, k[..., r:]], -1)


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
        self.mamba: MambaMixer | Mamba2Mixer | None = None
        shape = config.mixer
        if i in config.attention_layers:
            self.self_attn = PagedAttention(c, i, dtype=dtype)
        elif isinstance(shape, MixerShape):
            self.mamba = MambaMixer(shape, dtype=dtype)
        else:
            self.mamba = Mamba2Mixer(shape, dtype=dtype)
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
        # No Triton kernel here: its scratch needs the head counts, unknown to the backend.
        table = req_pool.req_to_token
        kv_dtype = kv_cache.get_kv(0)[0].dtype if config.attention_layers else torch.float32
        kernel = device_attention(table.device, table.shape[1], kv_dtype)
        self.attn_backend = TorchPagedBackend(
            table, kernel="torch" if kernel == "triton" else kernel
        )
        self.model = HybridBody(config, dtype)
        c = config.attention
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        )
        self.rotary: RotaryEmbedding = (
            _NoRotary()
            if config.rotary_dim == 0
            else _PartialRotary(config.rotary_dim, req_pool.max_context_len, c.rope_theta)
        )
        self.to(pool.device).requires_grad_(False)

    def forward_decode(self, inputs: BufferView) -> torch.Tensor:
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
