"""The frozen-KV MTP phase: the whole draft loop of a multi-token-prediction
head that reads the target's KV cache and writes none."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec, PadRule
from graphrunner.declare.outputs import OutputSpec
from graphrunner.pools import KVCache, ReqToTokenPool
from graphrunner.sanitizer.padding import GuardedTensor, PaddingSanitizer

if TYPE_CHECKING:  # the models implement these phases; phases sit below them
    from graphrunner.model.draft import FrozenKvMtpHead

__all__ = ["FrozenKvMtpRunner", "frozen_kv_sanitizer", "mtp_buffer_specs"]

_I64 = torch.int64


def mtp_buffer_specs(
    hidden_size: int, hidden_dtype: torch.dtype, *, seq_len_fill_value: int = 1
) -> list[BufferSpec]:
    """Per request: the bonus token ``input_ids``, ``req_pool_indices``,
    ``positions`` (0: slot 0), ``seq_lens`` (the committed length; the
    backend's fill) and the target's ``hidden_states`` (0). No ``out_cache_loc``:
    the head writes no KV slot, slot 0 included."""
    return [
        BufferSpec("input_ids", _I64, PadRule.ZERO, index=True),
        BufferSpec("req_pool_indices", _I64, PadRule.ZERO, index=True),
        BufferSpec(
            "seq_lens", _I64, PadRule.FILL, fill_value=seq_len_fill_value, backend_fill=True
        ),
        BufferSpec("positions", _I64, PadRule.ZERO, index=True),
        BufferSpec("hidden_states", hidden_dtype, PadRule.ZERO, extra_shape=(hidden_size,)),
    ]


class FrozenKvMtpRunner(GraphRunner):
    """Captures :meth:`FrozenKvMtpHead.forward_draft` (the whole draft loop).

    Replay returns ``tokens`` int64, ``scores`` float32 and ``parents`` int64,
    each ``[bs, steps, k]``.
    """

    def __init__(self, head: FrozenKvMtpHead, **kwargs: Any) -> None:
        target = head.target
        backend = target.attn_backend
        specs = mtp_buffer_specs(
            target.config.hidden_size,
            target.model.embed_tokens.weight.dtype,
            seq_len_fill_value=backend.seq_len_fill_value,
        )
        super().__init__(head.forward_draft, specs, outputs=OutputSpec(), backend=backend, **kwargs)


def frozen_kv_sanitizer(req_pool: ReqToTokenPool, kv_cache: KVCache) -> PaddingSanitizer:
    """A sanitizer for a read-only phase: no row of ``req_to_token`` or of any
    KV layer may change, slot 0 included."""
    guarded = [GuardedTensor("req_to_token", req_pool.req_to_token, None, sink_rows=0)]
    for layer in range(kv_cache.num_layers):
        k, v = kv_cache.get_kv(layer)
        guarded += [
            GuardedTensor(f"k_cache[{layer}]", k, None, sink_rows=0),
            GuardedTensor(f"v_cache[{layer}]", v, None, sink_rows=0),
        ]
    return PaddingSanitizer(guarded, req_pool=req_pool)
