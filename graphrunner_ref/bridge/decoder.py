"""A transformers ``*ForCausalLM`` decoder as a graphrunner model.

:class:`TransformersDecoder` runs the model's own modules (embedding, norms,
MLPs, rotary embedding of whatever type its config asks for, tied or separate
LM head, final-logit soft-capping) with :func:`~.attention.paged_attention`
over graphrunner's pools: ``forward_decode`` is the step a runner captures
(the decode buffers, padded by their declared rules), ``forward_extend`` a
request's eager prefill. The model is called on a step's token rows as one
sequence of batch 1 with ``use_cache=False``, as vLLM's Transformers backend
does; what differs between architectures stays in their modules. RoPE whose
frequencies transformers decides on the host (``dynamic``, ``longrope``) is
looked up by position in decode and computed by transformers' own module in
the prefill (:mod:`.rope`).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from graphrunner import BufferView, KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from graphrunner.declare import NullBackend
from graphrunner.pools import CachedKVAllocator, whole_pages
from graphrunner.util import needs_extra
from graphrunner_ref.bridge.attention import ATTENTION, StepKV, StepSlot, bind, register
from graphrunner_ref.bridge.experts import install_experts
from graphrunner_ref.bridge.find import AttentionLayers, find_attention
from graphrunner_ref.bridge.rope import RopeTable, has_dynamic_rope, install_rope_tables
from graphrunner_ref.model.build import PooledBundle

__all__ = [
    "TransformersBundle",
    "TransformersDecoder",
    "build_transformers_bundle",
    "load_transformers",
]

#: The default context when a config allows more (``max_context_len`` overrides).
DEFAULT_CONTEXT = 4096


class TransformersDecoder(nn.Module):
    """A transformers causal LM over a :class:`~graphrunner.KVCache` and the
    ``req_to_token`` table of a :class:`~graphrunner.ReqToTokenPool`.

    Args:
        hf: the ``*ForCausalLM`` module, its attention set to the bridge's
            (:data:`~.attention.ATTENTION`).
        kv_cache: one layer per attention layer, its KV heads and head size.
        req_pool: whose ``req_to_token`` (int32 ``[rows, context]``) the
            attention reads.
        layers: ``hf``'s attention layers (:func:`~.find.find_attention`),
            bound here to this decoder's step and their KV layers.
    """

    def __init__(
        self, hf: nn.Module, kv_cache: KVCache, req_pool: ReqToTokenPool, layers: AttentionLayers
    ) -> None:
        super().__init__()
        self.hf = hf
        #: The step the attention modules read while the model runs.
        self.slot = StepSlot()
        bind(layers.modules, self.slot)
        self.kv_cache = kv_cache
        self.req_to_token = req_pool.req_to_token
        #: The RoPE tables decode looks up; the prefill runs transformers' modules.
        self.rope_tables = tuple(m for m in hf.modules() if isinstance(m, RopeTable))
        #: The attention reads only the step's device tensors: no host planning.
        self.attn_backend = NullBackend()

    @property
    def config(self) -> Any:
        """The model's (text) config: ``vocab_size`` and the rest."""
        return _text_config(self.hf)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, step: StepKV) -> torch.Tensor:
        # The step reaches the attention through the slot, whatever the layers pass on.
        self.slot.step = step
        try:
            out = self.hf(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        finally:
            self.slot.step = None
        logits: torch.Tensor = out.logits[0]
        return logits.float()

    def forward_decode(self, inputs: BufferView) -> torch.Tensor:
        """One decode step: logits float32 ``[bs, vocab]`` from the decode fields
        (int64 ``[bs]``); each row's K/V written at its ``out_cache_loc``."""
        b = inputs
        step = StepKV(
            self.kv_cache, self.req_to_token, b.req_pool_indices, b.seq_lens, b.out_cache_loc
        )
        return self._logits(b.input_ids, b.positions, step)

    def forward_token_batch(self, inputs: BufferView) -> torch.Tensor:
        """A token batch (prompt chunks and decode rows in one step,
        :mod:`graphrunner.phases.token_batch`): logits float32 ``[R, vocab]``
        of each request's last token. Each token attends as a row of its own:
        its request's ``req_to_token`` row up to its position (its slots
        recorded already), its K/V written at its ``out_cache_loc``."""
        b = inputs
        step = StepKV(
            self.kv_cache, self.req_to_token, b.token_req_pool_indices, b.positions + 1,
            b.out_cache_loc,
        )  # fmt: skip
        return self._logits(b.input_ids, b.positions, step)[b.last_token_index]

    @torch.no_grad()
    def forward_extend(
        self,
        req_pool_index: int,
        token_ids: torch.Tensor,
        kv_slots: torch.Tensor,
        *,
        prefix_len: int = 0,
    ) -> torch.Tensor:
        """Eager prefill of one request: logits float32 ``[vocab]`` of its last
        token. Token ``i`` (int64 ``[n]``) sits at position ``prefix_len + i``,
        its K/V at ``kv_slots[i]``, recorded in ``req_to_token`` by this call."""
        n = token_ids.shape[0]
        positions = torch.arange(prefix_len, prefix_len + n, device=token_ids.device)
        self.req_to_token[req_pool_index, prefix_len : prefix_len + n] = kv_slots.to(torch.int32)
        rows = torch.full((n,), req_pool_index, dtype=torch.int64, device=token_ids.device)
        step = StepKV(self.kv_cache, self.req_to_token, rows, positions + 1, kv_slots)
        with ExitStack() as stack:
            # Never captured, so transformers may decide the prompt's RoPE on the
            # host: from its length, as its own prefill of this prompt does.
            for table in self.rope_tables:
                stack.enter_context(table.transformers_rope())
            return self._logits(token_ids, positions, step)[-1]


@dataclass(frozen=True, slots=True)
class TransformersBundle(PooledBundle):
    """A :class:`TransformersDecoder` and the pools it was built over (what
    the engine serves, as :class:`~graphrunner_ref.model.build.ModelBundle`)."""

    model: TransformersDecoder
    req_pool: ReqToTokenPool
    kv_alloc: TokenToKVPoolAllocator
    kv_cache: KVCache

    @property
    def config(self) -> Any:
        return self.model.config


def _text_config(hf: nn.Module) -> Any:
    config = hf.config
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def build_transformers_bundle(
    hf: nn.Module,
    *,
    max_requests: int,
    max_context_len: int | None = None,
    kv_slots: int | None = None,
    page_size: int = 1,
) -> TransformersBundle:
    """Pools for ``hf`` (on its device, in its dtype) and the decoder over them.

    ``max_context_len`` defaults to the config's ``max_position_embeddings``
    (at most :data:`DEFAULT_CONTEXT`), and may not exceed it unless the RoPE
    is ``dynamic`` (NTK scaling, made to run past it); ``kv_slots`` to
    ``max_requests`` full contexts in whole pages. A ``dynamic`` or
    ``longrope`` rotary module is replaced by its table over the context
    (:func:`~.rope.install_rope_tables`).

    The attention layers, their count and K/V shape are found by one probe
    forward (:func:`~.find.find_attention`), not read from module or config
    names. Experts that go through transformers' experts interface run row
    by row (:func:`~.experts.install_experts`), so no row's output depends
    on its neighbours' routing.

    Raises:
        ValueError: a bad size, or a model whose attention layers the bridge
            cannot keep (:func:`~.find.find_attention` names the reason).
    """
    register()
    config = _text_config(hf)
    layers = find_attention(hf.eval())
    hf.set_attn_implementation(ATTENTION)  # type: ignore[operator]
    install_experts(hf)
    limit = int(getattr(config, "max_position_embeddings", DEFAULT_CONTEXT))
    context = min(limit, DEFAULT_CONTEXT) if max_context_len is None else max_context_len
    if has_dynamic_rope(hf):
        # Dynamic NTK RoPE exists to run past max_position_embeddings.
        if context < 1:
            raise ValueError(
                f"max_context_len={context}: expected >= 1 (dynamic RoPE: "
                f"max_position_embeddings={limit} is no limit)"
            )
    elif not 1 <= context <= limit:
        raise ValueError(f"max_context_len={context}: expected 1..max_position_embeddings={limit}")
    slots = whole_pages(max_requests * context, page_size) if kv_slots is None else kv_slots
    param = next(hf.parameters())
    install_rope_tables(hf, context, param.dtype)
    kv_cache = KVCache(
        slots,
        num_layers=len(layers.modules),
        num_kv_heads=layers.kv_heads,
        head_dim=layers.head_dim,
        dtype=param.dtype,
        device=param.device,
        page_size=page_size,
    )
    req_pool = ReqToTokenPool(max_requests, context, device=param.device)
    # Shares full prompt pages once the engine indexes them (prefix caching).
    kv_alloc = CachedKVAllocator(slots, device=param.device, page_size=page_size)
    model = TransformersDecoder(hf.eval().requires_grad_(False), kv_cache, req_pool, layers)
    return TransformersBundle(model, req_pool, kv_alloc, kv_cache)


def load_transformers(
    path: str | Path,
    *,
    max_requests: int,
    max_context_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
) -> TransformersBundle:
    """A checkpoint directory of any transformers ``*ForCausalLM`` decoder
    (``AutoModelForCausalLM``), in ``dtype`` on ``device``, over new pools.

    The model is built with transformers' own attention and switched to the
    bridge's once its attention layers are found, so a decoder whose
    attention does not go through transformers' interface is refused by
    :func:`~.find.find_attention`, not by transformers' loader.

    Raises:
        ValueError: transformers cannot build the model (one line naming the
            checkpoint and transformers' reason), or as
            :func:`build_transformers_bundle`.
    """
    with needs_extra("text", "the transformers bridge"):
        from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as e:  # whatever transformers raises, one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(
            f"{path}: transformers cannot build the model ({type(e).__name__}: {first})"
        ) from None
    model: nn.Module = hf
    model.to(device)
    return build_transformers_bundle(
        model,
        max_requests=max_requests,
        max_context_len=max_context_len,
        page_size=page_size,
    )
