"""A Llama-style decoder over paged KV pools: the reference executor of graphrunner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner import BufferView
from graphrunner_ref.model.attention import PagedAttention
from graphrunner_ref.model.attention_backend import TorchPagedBackend, device_attention
from graphrunner_ref.model.attention_meta import AttnMetadata, KVStore
from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP
from graphrunner_ref.model.parallel import (
    SINGLE,
    TensorParallel,
    VocabParallelEmbedding,
    local_config,
    vocab_shard,
)
from graphrunner_ref.model.small_batch import MAX_ROWS, fits, rope_store_op, small_batch_linear
from graphrunner_ref.model.token_rows import TokenRows
from graphrunner_ref.model.weights import WeightError, copy_checked_weights


class ReqToToken(Protocol):
    req_to_token: torch.Tensor


class KVBuffers(KVStore, Protocol):
    k_buffers: list[torch.Tensor]


class LlamaDecoderLayer(nn.Module):
    """One block; ``config`` is the shape this rank holds (see
    :func:`~graphrunner_ref.model.parallel.local_config`): o_proj's and down_proj's
    partial sums are all-reduced over ``tp``."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        #: Steps of at most this many token rows run the small-batch linears, with
        #: or without PDL (``use_small_batch_linears``, ``use_programmatic_launch``).
        self.small_batch_rows, self.programmatic_launch = 0, False
        self.self_attn = PagedAttention(config, layer_id, dtype=dtype)
        self.mlp = SwiGLUMLP(
            config.hidden_size, config.intermediate_size, dtype=dtype, bias=config.mlp_bias
        )
        # The small-batch linears take no biases: a biased layer keeps the modules' path.
        self.biased = config.attention_bias or config.mlp_bias
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype
        )

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        kv: KVStore,
        meta: AttnMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        if fits(h.shape[0], self.small_batch_rows) and not self.biased:
            return self._forward_small_batch(h, positions, out_loc, kv, meta, rotary)
        attn = self.self_attn(self.input_layernorm(h), positions, out_loc, kv, meta, rotary)
        h = h + self.tp.all_reduce(attn)
        return h + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(h)))

    def _forward_small_batch(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        kv: KVStore,
        meta: AttnMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """:meth:`forward` through the small-batch linears (``h [n, hidden]``,
        :mod:`~graphrunner_ref.model.small_batch`)."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        pdl = self.programmatic_launch
        qkv = small_batch_linear(
            h, attn.qkv_weight, norm_weight=norm1.weight, eps=norm1.eps, pdl=pdl
        )
        heads = self._attend_small_batch(qkv, positions, out_loc, kv, meta, rotary)
        h = self._add_projected(h, heads, cast(torch.Tensor, attn.o_proj.weight))
        gated = small_batch_linear(
            h, mlp.gate_proj.weight, mlp.up_proj.weight, norm_weight=norm2.weight, eps=norm2.eps,
            pdl=pdl,
        )  # fmt: skip
        return self._add_projected(h, gated, cast(torch.Tensor, mlp.down_proj.weight))

    def _attend_small_batch(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        kv: KVStore,
        meta: AttnMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        """The heads' outputs from the stacked projection: rotary and KV write in
        one launch when the cache holds ``qkv``'s dtype (else the module's ops)."""
        attn = self.self_attn
        k_cache, v_cache = kv.get_kv(attn.layer_id)
        if k_cache.dtype != qkv.dtype:  # set_kv casts; the kernel writes the dtype it reads
            return attn.attend_qkv(qkv, positions, out_loc, kv, meta, rotary)
        q = rope_store_op(
            qkv, positions, out_loc, rotary.cos, rotary.sin, k_cache, v_cache, attn.num_heads,
            self.programmatic_launch,
        )  # fmt: skip
        return attn.attend_rotated(q, kv, meta)

    def _add_projected(
        self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """``h + all_reduce(x @ weight.T)``: alone on its rank, the add is the
        kernel's epilogue; tensor-parallel, it follows the all-reduce."""
        pdl = self.programmatic_launch
        if self.tp.alone:
            return small_batch_linear(x, weight, residual=h, pdl=pdl)
        return h + self.tp.all_reduce(small_batch_linear(x, weight, pdl=pdl))


class LlamaBody(nn.Module):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
            if tp.alone
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype=dtype)
        )
        local = local_config(config, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(local, i, dtype, tp) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


def is_derived(name: str) -> bool:
    """A checkpoint tensor the model derives instead of loading:
    ``*.rotary_emb.inv_freq`` (older transformers saved it; it follows from
    ``rope_theta``)."""
    return name.endswith("rotary_emb.inv_freq")


class LlamaDecoder(nn.Module):
    """Llama decoder reading and writing paged KV pools; parameter names match
    transformers' ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``...).

    Args:
        config: the model shape.
        req_to_token_pool: owns ``req_to_token``, int32 ``[num_reqs + 1, max_context_len]``.
        kv_cache: a :class:`graphrunner.pools.KVCache` with ``num_layers`` layers of
            ``[num_slots + page_size, H_kv, D]``; slot 0 is the padding sink (the
            rest of the padding page is never written).
        dtype: parameter and activation dtype; logits are always float32.
        tp: this rank's place in a tensor-parallel group (default: alone). With
            ``world > 1`` the model holds rank ``tp.rank``'s shard
            (:mod:`graphrunner_ref.model.parallel`): its query and KV heads (the KV
            cache must have this rank's ``H_kv``), its MLP slice, its
            ``vocab / world`` rows of the embedding and LM head; its outputs
            (logits ``[..., vocab]``) are the whole model's, gathered.

    The model is built on the KV cache's device, with gradients off.
    ``attn_backend`` is the :class:`TorchPagedBackend` runners hand their hooks to;
    its decode attention is the Triton kernel on a CUDA device and the torch
    attention elsewhere (``attn_backend.kernel`` switches it before capture).
    :func:`~graphrunner_ref.model.quantize.quantize_model` sets ``quantization``
    and ``head_proj`` (the int8 LM head).
    """

    def __init__(
        self,
        config: ModelConfig,
        req_to_token_pool: ReqToToken,
        kv_cache: KVBuffers,
        *,
        dtype: torch.dtype = torch.float32,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        local = local_config(config, tp)
        req_to_token = req_to_token_pool.req_to_token
        if req_to_token.shape[1] > config.max_position_embeddings:
            raise ValueError(
                f"req_to_token has max_context_len={req_to_token.shape[1]}: expected "
                f"<= max_position_embeddings={config.max_position_embeddings}"
            )
        if len(kv_cache.k_buffers) != config.num_layers:
            raise ValueError(
                f"kv_cache has {len(kv_cache.k_buffers)} layers: expected "
                f"num_layers={config.num_layers}"
            )
        if kv_cache.k_buffers[0].shape[1] != local.num_kv_heads:
            raise ValueError(
                f"kv_cache has {kv_cache.k_buffers[0].shape[1]} KV heads: expected "
                f"{local.num_kv_heads} (rank {tp.rank} of {tp.world})"
            )
        self.config, self.tp = config, tp
        #: The int8 LM head once quantized (None: ``lm_head_weight`` in the model's dtype).
        self.head_proj: nn.Module | None = None
        #: The ``quantize`` mode applied, or None.
        self.quantization: str | None = None
        #: Steps of at most this many rows run the small-batch linears (0: none);
        #: whether the model's Triton kernels launch programmatically (PDL).
        self.small_batch_rows, self.programmatic_launch = 0, False
        self.num_kv_groups = local.num_kv_groups  # this rank's query heads per KV head
        self.kv_cache = kv_cache
        kernel = device_attention(
            req_to_token.device, req_to_token.shape[1], kv_cache.k_buffers[0].dtype
        )
        self.attn_backend = TorchPagedBackend(
            req_to_token,
            kernel=kernel,
            kv_heads=local.num_kv_heads,
            heads=local.num_heads,
            head_dim=config.head_dim,
        )
        self.model = LlamaBody(config, dtype, tp)
        vocab = vocab_shard(config, tp)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, vocab, bias=False, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            None if config.rope_scaling is None else config.rope_scaling.scale,
        )
        self.to(req_to_token.device).requires_grad_(False)

    @property
    def vocab_size(self) -> int:
        """Columns of the logits (the whole vocabulary, every rank)."""
        return int(self.config.vocab_size)

    def forward_decode(self, inputs: BufferView) -> torch.Tensor:
        """One decode step: logits float32 ``[bs, vocab]`` for the ``bs`` rows of ``inputs``.

        Writes each row's new K/V at ``out_cache_loc``, then attends over
        ``req_to_token[req_pool_indices, :seq_lens]``. Static shapes, no host
        reads: safe to capture as a CUDA graph or an inductor program.
        """
        return self.logits(self._step_hidden(inputs))

    def forward_tokens(self, inputs: BufferView) -> dict[str, torch.Tensor]:
        """A multi-token step (target verify): ``W`` tokens per request.

        ``inputs``: per-token ``input_ids``, ``positions``, ``out_cache_loc``
        int64 ``[bs * W]`` (the tokens' slots already recorded in
        ``req_to_token``), per-request ``req_pool_indices`` int64 ``[bs]``.
        Returns ``logits`` float32 ``[bs * W, vocab]`` and the final-norm
        ``hidden`` ``[bs * W, hidden]`` (the features a draft head reads).
        Writes every token's K/V; static shapes, no host reads.
        """
        h = self._step_hidden(TokenRows(inputs))
        return {"logits": self.logits(h), "hidden": h}

    def forward_token_batch(self, inputs: BufferView) -> torch.Tensor:
        """A token batch (prompt chunks and decode rows in one step,
        :mod:`graphrunner.phases.token_batch`): logits float32 ``[R, vocab]``
        of each request's last token.

        ``inputs``: per token ``input_ids``, ``positions``, ``out_cache_loc``,
        ``token_req_pool_indices`` int64 ``[T]`` (the slots already recorded
        in ``req_to_token``); per request ``req_pool_indices``, ``seq_lens``,
        ``extend_lens``, ``last_token_index`` int64 ``[R]`` and, for the
        host-planned attention, ``seq_lens_cpu``, ``extend_lens_cpu``. Writes
        every token's K/V, then each token attends to its request's KV up to
        its own position.
        """
        meta = self.attn_backend.token_batch_metadata(inputs, self.num_kv_groups)
        h = self._hidden(inputs.input_ids, inputs.positions, inputs.out_cache_loc, meta)
        return self.logits(h[inputs.last_token_index])

    def forward_decode_hidden(self, inputs: BufferView) -> dict[str, torch.Tensor]:
        """:meth:`forward_decode` that also returns the final-norm ``hidden`` ``[bs, hidden]``."""
        h = self._step_hidden(inputs)
        return {"logits": self.logits(h), "hidden": h}

    def _step_hidden(self, inputs: BufferView) -> torch.Tensor:
        meta = self.attn_backend.decode_metadata(inputs, self.num_kv_groups)
        return self._hidden(inputs.input_ids, inputs.positions, inputs.out_cache_loc, meta)

    @torch.no_grad()
    def forward_extend(
        self,
        req_pool_index: int,
        token_ids: torch.Tensor,
        kv_slots: torch.Tensor,
        *,
        prefix_len: int = 0,
    ) -> torch.Tensor:
        """Eager prefill of one request: logits float32 ``[vocab]`` of its last token.

        token_ids, kv_slots: int64 ``[n]`` on the model's device; token ``i`` sits at
        position ``prefix_len + i`` and its K/V are written to ``kv_slots[i]``, which
        this call also records in ``req_to_token[req_pool_index, prefix_len:]``.
        The first ``prefix_len`` positions must already be cached.
        """
        hidden = self.extend_hidden(req_pool_index, token_ids, kv_slots, prefix_len=prefix_len)
        return self.logits(hidden[-1])

    @torch.no_grad()
    def extend_hidden(
        self,
        req_pool_index: int,
        token_ids: torch.Tensor,
        kv_slots: torch.Tensor,
        *,
        prefix_len: int = 0,
    ) -> torch.Tensor:
        """:meth:`forward_extend`'s final-norm hidden states ``[n, hidden]``, one
        per prompt token (a draft head's features; the LM head of the last gives
        the next token)."""
        n, width = token_ids.shape[0], prefix_len + token_ids.shape[0]
        if n < 1 or kv_slots.shape != token_ids.shape:
            raise ValueError(
                f"forward_extend: token_ids {tuple(token_ids.shape)} and kv_slots "
                f"{tuple(kv_slots.shape)}: expected the same non-empty [n]"
            )
        if req_pool_index < 1 or width > self.attn_backend.max_context_len:
            raise ValueError(
                f"forward_extend: req_pool_index={req_pool_index}, "
                f"prefix_len + n={width}: expected index >= 1 (0 is padding) and "
                f"length <= max_context_len={self.attn_backend.max_context_len}"
            )
        self.attn_backend.req_to_token[req_pool_index, prefix_len:width] = kv_slots
        positions = torch.arange(prefix_len, width, device=token_ids.device)
        meta = self.attn_backend.extend_metadata(
            req_pool_index, positions, width, self.num_kv_groups
        )
        return self._hidden(token_ids, positions, kv_slots, meta)

    def _hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, out_loc: torch.Tensor, meta: AttnMetadata
    ) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            h = layer(h, positions, out_loc, self.kv_cache, meta, self.rotary)
        return self.model.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head: float32 logits ``[..., vocab]`` of final-norm hidden states
        (each rank's vocabulary slice, gathered)."""
        if self.head_proj is not None:
            head = self.head_proj(h)
        elif h.dim() == 2 and fits(h.shape[0], self.small_batch_rows):
            head = small_batch_linear(h, self.lm_head_weight, pdl=self.programmatic_launch)
        else:
            head = F.linear(h, self.lm_head_weight)
        logits = self.tp.all_gather(head.float())
        if logits.shape[-1] != self.config.vocab_size:  # a padded vocabulary (vocab_shard)
            logits = logits[..., : self.config.vocab_size]
        return logits

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[ceil(vocab / tp.world), hidden]``: the LM head, or the embedding when tied
        (draft heads share it)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return head.weight

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy a transformers-named state dict in, cast to the model's dtype.

        Raises :class:`WeightError` naming the first missing, unexpected or
        misshapen tensor. Ignored: ``*.rotary_emb.inv_freq`` (older transformers
        saved it; it is derived from ``rope_theta``) and, for tied embeddings, an
        ``lm_head.weight`` equal to ``model.embed_tokens.weight``.
        """
        given = {k: v for k, v in weights.items() if not is_derived(k)}
        if self.lm_head is None and "lm_head.weight" in given:
            head = given.pop("lm_head.weight")
            embed = given.get("model.embed_tokens.weight")
            if embed is None or not torch.equal(head, embed):
                raise WeightError(
                    "unexpected tensor 'lm_head.weight': the config ties word "
                    "embeddings, and it differs from model.embed_tokens.weight"
                )
        copy_checked_weights(self, given)


def use_small_batch_linears(model: LlamaDecoder, max_rows: int) -> None:
    """Run ``model``'s steps of at most ``max_rows`` token rows (``0``: none,
    the default) through the small-batch linears. Call it before capture: a
    captured size keeps the path it was captured with.

    Raises ``ValueError`` for ``max_rows`` outside ``0..MAX_ROWS`` or a
    quantized model (its linears hold compact weights the kernels do not read).
    """
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 0 <= max_rows <= MAX_ROWS:
        raise ValueError(
            f"use_small_batch_linears: max_rows={max_rows!r}: expected an int in 0..{MAX_ROWS}"
        )
    if model.quantization is not None and max_rows:
        raise ValueError(
            f"use_small_batch_linears: the model is quantized ({model.quantization!r}); "
            "the small-batch linears read float weights (leave max_rows=0)"
        )
    model.small_batch_rows = max_rows
    for layer in model.model.layers:
        cast(LlamaDecoderLayer, layer).small_batch_rows = max_rows
