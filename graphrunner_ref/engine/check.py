"""The engine's check mode: every decode step also run by the eager forward and
compared (logits, and the KV cache outside the live rows' new slots); a launch
of several decode steps (:meth:`CheckMode.launch`) against that many single
eager steps of its running rows (tokens too)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphrunner import DecodeBatch, KVCache
from graphrunner.phases import SpecBatch
from graphrunner.pools import Int8KVCache
from graphrunner.sampling import SAMPLING_FIELD_NAMES, sample_rows
from graphrunner_ref.engine.model_runner import ModelRunner, logits_of
from graphrunner_ref.engine.results import EngineStats, LiveRequest
from graphrunner_ref.engine.sampling import StepOut

__all__ = ["CheckMode"]


class CheckMode:
    """The engine's check mode (``Engine(check=True)``): each step, or each
    launch of several steps, also run eagerly and compared into the run's
    :class:`~graphrunner_ref.engine.results.EngineStats`.

    Args:
        engine: the model runner whose steps it checks.
    """

    def __init__(self, engine: ModelRunner) -> None:
        if engine.sampling_rows.counts is not None:  # an eager rerun would count twice
            raise ValueError(
                "check=True with a runner that applies penalties (penalties=True): the eager "
                "rerun would count each token again; expected check=False"
            )
        self.engine = engine

    def replay(
        self, batch: DecodeBatch, stats: EngineStats, live: Sequence[LiveRequest] = ()
    ) -> StepOut:
        """One decode step checked (see :func:`checked_replay`)."""
        return checked_replay(self.engine, batch, stats, live)

    def launch(
        self,
        inputs: Any,
        budgets: list[int],
        stats: EngineStats,
        replay: Callable[[], StepOut],
    ) -> StepOut:
        """A launch of several steps checked (see :func:`checked_launch`)."""
        return checked_launch(self.engine, inputs, budgets, stats, replay)


def checked_replay(
    engine: ModelRunner, batch: DecodeBatch, stats: EngineStats, live: Sequence[LiveRequest] = ()
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
    kv = _kv_of(engine)
    decoder = engine.decoder
    with torch.no_grad():
        ref, eager_seconds = engine.timed(lambda: decoder.forward(engine.step_inputs(batch)))
    before = [t.clone() for t in _kv_values(kv)]
    step, seconds = engine.timed(lambda: engine.replay(batch, live))
    out = logits_of(step)
    stats.eager_seconds += eager_seconds
    stats.decode_seconds += seconds
    flips = (out.argmax(-1) != ref.argmax(-1)).sum()
    # A token flip with logits inside atol is a near-tie (the two logits differ
    # by at most 2 * atol), not a divergence.
    _record(engine, stats, 1, (out - ref).abs().max(), _kv_diff(kv, before), flips, False)
    return step


def checked_launch(
    engine: ModelRunner,
    inputs: Any,
    budgets: list[int],
    stats: EngineStats,
    replay: Callable[[], StepOut],
) -> StepOut:
    """A launch of ``N`` decode steps checked: first ``N`` single eager steps
    of the rows still running (each row's ``budgets[i]`` at most, stopping at
    the engine's end token; tokens picked as the launch picks them) from the
    launch's ``inputs`` (its decode fields, ``out_cache_loc`` ``[bs * N]``,
    the sampling rows when the engine samples), then the launch (``replay``);
    returns its outputs.

    Compared: the tokens ``[bs, N]`` exactly, each row's last logits
    ``[bs, vocab]`` within ``atol``, and the KV cache outside slot 0 after
    the launch against the state the eager steps left (the launch rewrites
    the same reserved slots, and no other). A token that differs is a
    mismatch here: inside a launch it feeds the next steps.
    """
    kv = _kv_of(engine)
    with torch.no_grad():
        (ref_tokens, ref_logits), eager_seconds = engine.timed(
            lambda: _eager_steps(engine, inputs, budgets)
        )
    before = [t.clone() for t in _kv_values(kv)]
    out, seconds = engine.timed(replay)
    stats.eager_seconds += eager_seconds
    stats.decode_seconds += seconds
    if not isinstance(out, dict):
        raise TypeError("a multi-step runner returns a dict of outputs; got a tensor")
    steps = ref_tokens.shape[1]
    flips = (out["tokens"] != ref_tokens).sum()
    logit_diff = (out["logits"] - ref_logits).abs().max()
    _record(engine, stats, steps, logit_diff, _kv_diff(kv, before), flips, True)
    return out


def _eager_steps(
    engine: ModelRunner, inputs: Any, budgets: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's tokens ``[bs, N]`` (-1 where it takes no step) and the
    logits ``[bs, vocab]`` of its last step, from single eager decode steps."""
    dev, bs = engine.device, len(budgets)
    slots = inputs.out_cache_loc.to(dev).view(bs, -1)
    ids, pos = inputs.input_ids.to(dev).clone(), inputs.positions.to(dev).clone()
    rows = inputs.req_pool_indices.to(dev)
    tokens = torch.full(slots.shape, -1, dtype=torch.int64, device=dev)
    last: torch.Tensor | None = None
    alive = [i for i in range(bs) if budgets[i] > 0]
    for j in range(slots.shape[1]):
        if not alive:
            break
        at = torch.tensor(alive, device=dev)
        step = SpecBatch(
            req_pool_indices_cpu=inputs.req_pool_indices_cpu[alive],
            seq_lens_cpu=inputs.seq_lens_cpu[alive] + j,
            input_ids=ids[at],
            positions=pos[at],
            seq_lens=pos[at] + 1,
            req_pool_indices=rows[at],
            out_cache_loc=slots[at, j],
        )
        logits = engine.decoder.forward(step)
        if engine.sampling:
            picked = {f: getattr(inputs, f).to(dev)[at] for f in SAMPLING_FIELD_NAMES}
            token = sample_rows(logits, picked, step.positions + 1)
        else:
            token = logits.argmax(-1)
        last = logits.new_zeros(bs, logits.shape[-1]) if last is None else last
        tokens[at, j], last[at], ids[at], pos[at] = token, logits, token, pos[at] + 1
        alive = [
            i
            for i, t in zip(alive, token.tolist(), strict=True)
            if t != engine.end_token and j + 1 < budgets[i]
        ]
    if last is None:
        raise ValueError(f"budgets={budgets}: expected a row with a step to take")
    return tokens, last


def _kv_of(engine: ModelRunner) -> KVCache:
    kv = engine.bundle.kv_cache
    if kv is None:
        raise ValueError("check=True: the bundle has no KV cache to compare; expected check=False")
    return kv


def _kv_values(kv: KVCache) -> list[torch.Tensor]:
    """The cache's K and V buffers, an int8 cache's dequantized (a value one
    float32 rounding off may take the next integer: a scale apart, not 1)."""
    if not isinstance(kv, Int8KVCache):
        return [*kv.k_buffers, *kv.v_buffers]
    scales = (*kv.k_scales, *kv.v_scales)
    values = (*kv.k_buffers, *kv.v_buffers)
    return [
        Int8KVCache.dequantize(q, d, torch.float32) for q, d in zip(values, scales, strict=True)
    ]


def _kv_diff(kv: KVCache, before: list[torch.Tensor]) -> torch.Tensor:
    """The largest change of the KV cache since ``before``, slot 0 (the padding sink) excepted."""
    after = _kv_values(kv)
    return torch.stack(
        [(a[1:] - b[1:]).abs().max() for a, b in zip(after, before, strict=True)]
    ).max()


def _record(
    engine: ModelRunner,
    stats: EngineStats,
    steps: int,
    logit_diff: torch.Tensor,
    kv_diff: torch.Tensor,
    flips: torch.Tensor,
    flips_mismatch: bool,
) -> None:
    """Read the differences back (one sync) into ``stats``; a mismatch when
    logits or KV differ beyond ``atol`` (or, ``flips_mismatch``, a token)."""
    logit, kv_d, n_flips = torch.stack([logit_diff, kv_diff.float(), flips.float()]).tolist()
    stats.checked_steps += steps
    stats.max_logit_diff = max(stats.max_logit_diff, logit)
    stats.max_kv_diff = max(stats.max_kv_diff, kv_d)
    stats.token_flips += int(n_flips)
    if not (logit <= engine.atol and kv_d <= engine.atol) or (flips_mismatch and n_flips):
        stats.mismatches += 1
