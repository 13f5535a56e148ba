"""The frozen-KV MTP phase: the whole draft loop of a multi-token-prediction
head that reads the target's KV cache and writes none."""

from __future__ import annotations

from typing import Any

import torch

from graphrunner.core.create import runner_parts
from graphrunner.core.options import RunnerOptions
from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec, PadRule
from graphrunner.declare.decode import OUT_CACHE_LOC, decode_buffer_specs
from graphrunner.declare.outputs import OutputSpec
from graphrunner.phases.base import Phase
from graphrunner.phases.models import MtpDraftModel
from graphrunner.pools import KVCache, ReqToTokenPool
from graphrunner.sampling import SAMPLING_FIELDS
from graphrunner.sanitizer.padding import GuardedTensor, PaddingSanitizer

__all__ = ["FrozenKvMtpRunner", "frozen_kv_mtp_phase", "frozen_kv_sanitizer", "mtp_buffer_specs"]

#: The decode field a frozen-KV head does not read: it writes no KV slot.
_NO_KV_WRITE = frozenset({OUT_CACHE_LOC})


def mtp_buffer_specs(
    hidden_size: int, hidden_dtype: torch.dtype, *, seq_len_fill_value: int = 1
) -> list[BufferSpec]:
    """The decode fields less ``out_cache_loc`` (the head writes no KV slot,
    slot 0 included), with decode's pad rules (``seq_lens``: the committed
    length, the backend's fill), plus the target's ``hidden_states``
    ``[bs, hidden]`` (0)."""
    hidden = BufferSpec("hidden_states", hidden_dtype, PadRule.ZERO, extra_shape=(hidden_size,))
    decode = decode_buffer_specs(seq_len_fill_value=seq_len_fill_value, without=_NO_KV_WRITE)
    return [*decode, hidden]


def frozen_kv_mtp_phase(head: MtpDraftModel, *, sampling: bool = False) -> Phase:
    """:meth:`MtpDraftModel.forward_draft` (the whole draft loop); outputs
    ``tokens`` int64, ``scores`` float32 and ``parents`` int64, each ``[bs, steps, k]``.

    ``sampling``: :meth:`MtpDraftModel.forward_draft_sampled` instead, over
    the sampling buffers too (:data:`~graphrunner.sampling.SAMPLING_FIELDS`);
    outputs ``tokens`` ``[bs, steps, 1]`` and ``probs`` ``[bs, steps, V]``."""
    backend = head.attn_backend
    specs = mtp_buffer_specs(
        head.hidden_size,
        head.hidden_dtype,
        seq_len_fill_value=backend.seq_len_fill_value,
    )
    if sampling:
        specs += SAMPLING_FIELDS
    forward = head.forward_draft_sampled if sampling else head.forward_draft
    return Phase("mtp", forward, tuple(specs), outputs=OutputSpec(), backend=backend)


class FrozenKvMtpRunner(GraphRunner):
    """``create_runner(frozen_kv_mtp_phase(head, sampling=sampling), ...)``.

    Replay returns ``tokens`` int64, ``scores`` float32 and ``parents`` int64,
    each ``[bs, steps, k]`` (``sampling``: ``tokens`` and ``probs``, see
    :func:`frozen_kv_mtp_phase`).
    """

    def __init__(
        self,
        head: MtpDraftModel,
        *,
        sampling: bool = False,
        options: RunnerOptions | None = None,
        **fields: Any,
    ) -> None:
        phase = frozen_kv_mtp_phase(head, sampling=sampling)
        super().__init__(*runner_parts(phase, None, options, fields))


def frozen_kv_sanitizer(
    req_pool: ReqToTokenPool, kv_cache: KVCache, *, vocab_size: int | None = None
) -> PaddingSanitizer:
    """A sanitizer for a read-only phase: no row of ``req_to_token`` or of any
    KV layer may change, slot 0 included; ``vocab_size`` bounds live token ids."""
    guarded = [GuardedTensor("req_to_token", req_pool.req_to_token, None, 0, "request row")]
    for layer in range(kv_cache.num_layers):
        k, v = kv_cache.get_kv(layer)
        guarded += [
            GuardedTensor(f"k_cache[{layer}]", k, None, 0, "KV slot"),
            GuardedTensor(f"v_cache[{layer}]", v, None, 0, "KV slot"),
        ]
    return PaddingSanitizer(guarded, req_pool=req_pool, vocab_size=vocab_size)
