"""The logits processors a sampled step runs before its sampler, in order:
the penalties and logit bias (:mod:`graphrunner.sampling.penalties`), the
``min_tokens`` hold of the end tokens (:mod:`graphrunner.sampling.min_tokens`),
then a grammar's token bitmask (:mod:`graphrunner.sampling.bitmask`). Loaded
only by a step that runs one, so a plain sampled step never imports them."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch

from graphrunner.sampling.bitmask import apply_token_bitmask
from graphrunner.sampling.gate import unless
from graphrunner.sampling.min_tokens import hold_end_tokens
from graphrunner.sampling.penalties import PENALTY_FIELD_NAMES, TokenCounts, penalize

#: The per-row penalties, by field name.
PENALTY_NAMES = ("repetition_penalty", "presence_penalty", "frequency_penalty")

__all__ = ["process_logits"]


def process_logits(
    logits: torch.Tensor,
    b: Any,
    req_pool_indices: torch.Tensor,
    position: torch.Tensor,
    counts: TokenCounts | None,
    bitmask: torch.Tensor | None,
    *,
    live: torch.Tensor,
) -> torch.Tensor:
    """``logits`` (float ``[n, V]``) as the sampler reads them: with
    ``counts``, penalized and biased (``b``'s penalty buffers, the counts of
    rows ``req_pool_indices`` int64 ``[n]``) and the end tokens held where
    ``position`` (int64 ``[n]``) is short of ``min_tokens``; with
    ``bitmask`` (a grammar's, int32 ``[n, ceil(V / 32)]``), only the tokens
    it allows. Float32 ``[n, V]``; graph-safe.

    Each pass over the vocabulary runs only when a ``live`` row (bool
    ``[n]``) needs it (:func:`~graphrunner.sampling.gate.unless`: on the CPU;
    a device graph runs all three): rows not live may keep their logits."""
    x = logits.to(torch.float32)
    if counts is not None:
        fields = {name: getattr(b, name) for name in PENALTY_FIELD_NAMES}
        x = _penalized(x, counts, req_pool_indices, fields, live)
        held = live & (position < fields["hold_until"])
        x = unless(
            held.any(),
            lambda x, position, until, ids: hold_end_tokens(
                x, position, {"hold_until": until, "hold_ids": ids}
            ),
            _unchanged,
            (x, position, fields["hold_until"], fields["hold_ids"]),
        )
    if bitmask is not None:
        masks = live & (bitmask != -1).any(-1)  # a row of all ones allows every token
        x = unless(masks.any(), apply_token_bitmask, _unchanged, (x, bitmask))
    return x


def _penalized(
    x: torch.Tensor,
    counts: TokenCounts,
    req_pool_indices: torch.Tensor,
    fields: dict[str, torch.Tensor],
    live: torch.Tensor,
) -> torch.Tensor:
    """:func:`penalize` where a live row has a penalty or a bias (neutral:
    repetition 1, presence and frequency 0, every bias value 0)."""
    rep, pres, freq = (fields[n] for n in PENALTY_NAMES)
    ids, values = fields["logit_bias_ids"], fields["logit_bias_values"]
    biased = (values != 0).any(-1)
    needed = live & ((rep != 1) | (pres != 0) | (freq != 0) | biased)

    def full(
        x: torch.Tensor, rows: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor,
        freq: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
        prompt: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        named = dict(zip(PENALTY_NAMES, (rep, pres, freq), strict=True))
        fields = {**named, "logit_bias_ids": ids, "logit_bias_values": values}
        return penalize(x, cast(TokenCounts, _Tables(table, prompt)), rows, fields)

    operands = (x, req_pool_indices, rep, pres, freq, ids, values)
    return unless(needed.any(), full, _unchanged, operands, (counts.counts, counts.prompt))


class _Tables(NamedTuple):
    """What :func:`penalize` reads of a :class:`TokenCounts`, as branch operands."""

    counts: torch.Tensor
    prompt: torch.Tensor


def _unchanged(x: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    """The logits as they came, a new tensor (a compiled branch may not
    return its input)."""
    return x.clone()
