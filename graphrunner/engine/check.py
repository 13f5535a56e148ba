"""The engine's check mode: every decode step also run by the eager forward and
compared (logits, and the KV cache outside the live rows' new slots)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.engine.results import EngineStats, _Live
from graphrunner.engine.sampling import StepOut, logits_of

if TYPE_CHECKING:
    from graphrunner.engine.loop import Engine

__all__ = ["checked_replay"]


def checked_replay(
    engine: Engine, batch: DecodeBatch, stats: EngineStats, live: Sequence[_Live] = ()
) -> StepOut:
    """Eager reference first, then the runner, on the same prepared batch
    (``live[i]`` its row ``i``); returns the runner's output (its logits
    ``[bs, vocab]`` are compared).

    Both write the new tokens' K/V at ``out_cache_loc`` before reading, so
    the second run overwrites the first's writes and reads nothing else of
    it. The reference goes first because it touches live rows only: every
    value it reads is the true state. A snapshot of the KV cache between
    the two then shows any write of the runner outside the live rows'
    ``out_cache_loc`` (slot 0, the padding sink, excepted). The runner's
    outputs drive the engine; this check syncs, it is not the hot path.
    """
    kv = engine.bundle.kv_cache
    if kv is None:
        raise ValueError("check=True: the bundle has no KV cache to compare; expected check=False")
    decoder = engine.decoder
    with torch.no_grad():
        ref, eager_seconds = engine.timed(lambda: decoder.forward(decoder.inputs(batch)))
    before = [t.clone() for t in (*kv.k_buffers, *kv.v_buffers)]
    step, seconds = engine.timed(lambda: engine.replay(batch, live))
    out = logits_of(step)
    stats.eager_seconds += eager_seconds
    stats.decode_seconds += seconds
    after = (*kv.k_buffers, *kv.v_buffers)
    kv_diff = torch.stack(
        [(a[1:] - b[1:]).abs().max() for a, b in zip(after, before, strict=True)]
    ).max()
    flips = (out.argmax(-1) != ref.argmax(-1)).sum()
    logit_diff, kv_diff_f, n_flips = torch.stack(
        [(out - ref).abs().max(), kv_diff.float(), flips.float()]
    ).tolist()
    stats.checked_steps += 1
    stats.max_logit_diff = max(stats.max_logit_diff, logit_diff)
    stats.max_kv_diff = max(stats.max_kv_diff, kv_diff_f)
    stats.token_flips += int(n_flips)
    # A token flip with logits inside atol is a near-tie (the two logits differ
    # by at most 2 * atol), not a divergence.
    if not (logit_diff <= engine.atol and kv_diff_f <= engine.atol):
        stats.mismatches += 1
    return step
