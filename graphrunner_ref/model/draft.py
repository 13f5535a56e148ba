"""Draft heads for speculative decoding over the reference Llama.

- :class:`EagleHead`: one decoder layer over ``fc([embed(token), feature])``
  with its own KV cache (the target's slot indices and ``req_to_token``, its
  own K/V tensors; slot 0 the padding sink), sharing the target's embedding
  and LM head. Row ``p`` pairs the token at ``p + 1`` with the target's
  feature at ``p`` and predicts the token at ``p + 2`` (EAGLE's shift).
- :class:`FrozenKvMtpHead`: a multi-token-prediction head whose attention is
  query-only over the target's KV cache (one layer of it), read through the
  target's ``req_to_token`` up to the committed length: it owns no KV and
  writes no slot. Its whole draft loop, top-k between steps, is one forward.

Random weights are fine for the library: speculative decoding is lossless
whatever the draft proposes; a better draft only accepts more.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from graphrunner import BufferView, KVCache
from graphrunner.sampling import SAMPLING_FIELD_NAMES, draft_sample
from graphrunner_ref.model.attention_backend import TorchPagedBackend
from graphrunner_ref.model.attention_meta import AttnMetadata, attend
from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.layers import RMSNorm, SwiGLUMLP
from graphrunner_ref.model.llama import LlamaDecoder, LlamaDecoderLayer
from graphrunner_ref.model.token_rows import TokenRows

__all__ = ["EagleHead", "FrozenKvMtpHead", "init_draft_weights"]


def _topk_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.softmax(logits, dim=-1).topk(k, dim=-1)


class _Fusion(nn.Module):
    """``fc([norm(embed(token)), norm(feature)])``: a draft row's input."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)
        self.feature_norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype)
        self.fc = nn.Linear(2 * h, h, bias=False, dtype=dtype)

    def forward(self, embedded: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embed_norm(embedded), self.feature_norm(feature)], -1))


class _TargetFacts(nn.Module):
    """What a draft phase reads of a head (:mod:`graphrunner.phases.models`):
    the target's hidden width and dtype, and its attention backend."""

    @property
    def target(self) -> LlamaDecoder:
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        return int(self.target.config.hidden_size)

    @property
    def hidden_dtype(self) -> torch.dtype:
        return self.target.model.embed_tokens.weight.dtype

    @property
    def attn_backend(self) -> TorchPagedBackend:
        return self.target.attn_backend


class EagleHead(_TargetFacts):
    """EAGLE-style draft head (see the module doc).

    Args:
        target: the target model; its embedding, LM head, rotary table and
            ``req_to_token`` are shared, never copied.
        kv_cache: the head's own one-layer KV cache, with as many slots as the
            target's (the draft writes the same slot indices).
        topk: candidates returned per request.
    """

    def __init__(self, target: LlamaDecoder, kv_cache: KVCache, *, topk: int = 1) -> None:
        super().__init__()
        config, dtype = target.config, target.model.embed_tokens.weight.dtype
        if kv_cache.num_layers != 1 or kv_cache.k_buffers[0].shape[0] != _slots(target):
            raise ValueError(
                f"EagleHead: kv_cache has {kv_cache.num_layers} layers of "
                f"{kv_cache.k_buffers[0].shape[0]} slots; expected 1 layer of the target's "
                f"{_slots(target)} slots"
            )
        self._target = [target]  # shared, not a submodule (its weights are not the head's)
        self.kv_cache, self.topk = kv_cache, topk
        self.fusion = _Fusion(config, dtype)
        self.layer = LlamaDecoderLayer(config, 0, dtype)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.to(kv_cache.device).requires_grad_(False)

    @property
    def target(self) -> LlamaDecoder:
        return self._target[0]

    def _run(self, rows: BufferView, features: torch.Tensor) -> torch.Tensor:
        target = self.target
        x = self.fusion(target.model.embed_tokens(rows.input_ids), features)
        meta = target.attn_backend.decode_metadata(rows, target.config.num_kv_groups)
        h = self.layer(x, rows.positions, rows.out_cache_loc, self.kv_cache, meta, target.rotary)
        return self.norm(h)

    def _propose(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        probs, ids = _topk_probs(self.target.logits(h), self.topk)
        return {"topk_p": probs, "topk_index": ids, "hidden": h}

    def forward_extend(self, inputs: BufferView) -> dict[str, torch.Tensor]:
        """Draft extend over ``W`` verified tokens per request.

        ``inputs``: per-token ``input_ids``, ``positions``, ``out_cache_loc``
        int64 ``[bs * W]`` and ``hidden_states`` ``[bs * W, hidden]``;
        per-request ``req_pool_indices`` and ``accept_lens`` int64 ``[bs]``.
        Writes K/V for all ``W`` tokens, selects each request's last accepted
        token (``row * W + accept_len - 1``) and applies the LM head to those
        rows only. Returns ``topk_p`` float32 ``[bs, k]``, ``topk_index`` int64
        ``[bs, k]`` and the selected ``hidden`` ``[bs, hidden]``.
        """
        rows = TokenRows(inputs)
        h = self._run(rows, inputs.hidden_states)
        return self._propose(h[rows.select(inputs.accept_lens)])

    def forward_decode(self, inputs: BufferView) -> dict[str, torch.Tensor]:
        """One draft token per request: decode fields int64 ``[bs]`` plus
        ``hidden_states`` ``[bs, hidden]`` (the previous draft step's)."""
        return self._propose(self._run(inputs, inputs.hidden_states))


def _slots(target: LlamaDecoder) -> int:
    return int(target.kv_cache.k_buffers[0].shape[0])


class FrozenKvMtpHead(_TargetFacts):
    """Multi-token-prediction head reading the target's KV cache, read-only.

    Args:
        target: the target model (embedding, LM head, rotary table,
            ``req_to_token`` and KV cache shared).
        steps: draft tokens per request (the seed step plus ``steps - 1``).
        topk: candidates kept per request between steps (1: a chain).
        kv_layer: the target layer whose K/V the head attends to.
    """

    def __init__(
        self, target: LlamaDecoder, *, steps: int, topk: int = 1, kv_layer: int = -1
    ) -> None:
        super().__init__()
        c, dtype = target.config, target.model.embed_tokens.weight.dtype
        self._target = [target]
        self.steps, self.topk = steps, topk
        self.kv_layer = kv_layer % c.num_layers
        self.fusion = _Fusion(c, dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, dtype=dtype)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        self.to(target.kv_cache.k_buffers[0].device).requires_grad_(False)

    @property
    def target(self) -> LlamaDecoder:
        return self._target[0]

    def _block(self, x: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        """One layer whose attention only queries the frozen target KV."""
        t, c = self.target, self.target.config
        n = x.shape[0]
        q = self.q_proj(self.input_layernorm(x)).view(n, c.num_heads, c.head_dim)
        q, _ = t.rotary(positions, q, q[:, :1])
        k_buf, v_buf = t.kv_cache.get_kv(self.kv_layer)
        q = q.view(n, c.num_kv_heads, c.num_kv_groups, c.head_dim)
        out = attend(q, k_buf, v_buf, meta, self.scale)
        h = x + self.o_proj(out.reshape(n, -1))
        return self.norm(h + self.mlp(self.post_attention_layernorm(h)))

    def _step(
        self, ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, meta: AttnMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.target
        h = self._block(self.fusion(t.model.embed_tokens(ids), features), positions, meta)
        return h, t.logits(h).log_softmax(-1)

    def forward_draft(self, inputs: BufferView) -> dict[str, torch.Tensor]:
        """The whole draft loop for ``bs`` requests.

        ``inputs`` (per request): ``input_ids`` (the bonus token),
        ``req_pool_indices``, ``seq_lens`` (the committed length), ``positions``
        (the last committed position, kept for every step) int64 ``[bs]`` and
        ``hidden_states`` ``[bs, hidden]`` (the target's feature there).
        Returns ``tokens`` int64, ``scores`` float32 (cumulative log
        probabilities) and ``parents`` int64 (the previous step's candidate
        each extends; -1 at the seed step), all ``[bs, steps, k]``.
        """
        b, k = inputs, self.topk
        bs = b.req_pool_indices.shape[0]
        meta = self._meta(b.req_pool_indices, b.seq_lens, 1)
        h, logp = self._step(b.input_ids, b.hidden_states, b.positions, meta)
        score, token = logp.topk(k, dim=-1)  # [bs, k]
        tokens, scores = [token], [score]
        parents = [torch.full_like(token, -1)]
        meta = self._meta(b.req_pool_indices, b.seq_lens, k)
        positions = b.positions.repeat_interleave(k)
        features = h.repeat_interleave(k, 0)
        for _ in range(self.steps - 1):
            h, logp = self._step(token.reshape(-1), features, positions, meta)
            child_score, child = logp.topk(k, dim=-1)  # [bs * k, k]
            total = (score.reshape(-1, 1) + child_score).view(bs, k * k)
            score, pick = total.topk(k, dim=-1)  # [bs, k]
            parent = pick // k
            token = child.view(bs, k * k).gather(1, pick)
            rows = torch.arange(bs, device=pick.device)[:, None] * k + parent
            features = h[rows.reshape(-1)]
            tokens.append(token)
            scores.append(score)
            parents.append(parent)
        return {
            "tokens": torch.stack(tokens, 1),
            "scores": torch.stack(scores, 1),
            "parents": torch.stack(parents, 1),
        }

    def forward_draft_sampled(self, inputs: BufferView) -> dict[str, torch.Tensor]:
        """The draft loop as a chain (``topk`` 1) whose tokens are drawn.

        ``inputs``: :meth:`forward_draft`'s plus the sampling rows
        (:data:`~graphrunner.sampling.SAMPLING_FIELDS`, each ``[bs]``). Step
        ``s`` draws its token by :func:`~graphrunner.sampling.draft_sample`
        at position ``positions + 2 + s`` (greedy rows: the argmax). Returns
        ``tokens`` int64 ``[bs, steps, 1]`` and ``probs`` float32
        ``[bs, steps, V]``, the ``q`` each token was drawn from.
        """
        b, t = inputs, self.target
        if self.topk != 1:
            raise ValueError(f"forward_draft_sampled: topk={self.topk}; expected 1 (a chain)")
        rows = {n: getattr(b, n) for n in SAMPLING_FIELD_NAMES}
        meta = self._meta(b.req_pool_indices, b.seq_lens, 1)
        ids, features, tokens, probs = b.input_ids, b.hidden_states, [], []
        for s in range(self.steps):
            features = self._block(
                self.fusion(t.model.embed_tokens(ids), features), b.positions, meta
            )
            ids, q = draft_sample(t.logits(features), rows, b.positions + 2 + s)
            tokens.append(ids)
            probs.append(q)
        return {"tokens": torch.stack(tokens, 1).unsqueeze(-1), "probs": torch.stack(probs, 1)}

    def _meta(self, req: torch.Tensor, seq_lens: torch.Tensor, k: int) -> AttnMetadata:
        """Read exactly the committed length of each request, ``k`` candidate rows each."""
        return self.target.attn_backend.rows_metadata(
            req.repeat_interleave(k),
            seq_lens.repeat_interleave(k),
            self.target.config.num_kv_groups,
        )


@torch.no_grad()
def init_draft_weights(head: nn.Module, seed: int) -> None:
    """Seeded random weights for a draft head (norms near 1, projections scaled)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in head.named_parameters():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        else:
            value = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1])
        param.copy_(value)
