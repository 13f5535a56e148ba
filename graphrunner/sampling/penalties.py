"""Repetition, presence and frequency penalties and logit bias, inside the step.

vLLM's (and OpenAI's) meaning, applied to a row's logits in this order
before the sampler (:func:`penalize`):

1. logit bias: ``logits[t] += bias[t]`` for the row's (token, bias) pairs;
2. repetition penalty ``r`` over the tokens seen in the prompt or the
   output: a positive logit divided by ``r``, a negative one multiplied;
3. frequency penalty ``f``: ``logits -= f * count`` (output occurrences);
4. presence penalty ``p``: ``logits -= p * (count > 0)``.

The same rows carry vLLM's ``min_tokens`` (:mod:`graphrunner.sampling.min_tokens`:
the end tokens held back at ``-inf`` until the request holds that many new
tokens), applied by the step after these.

The counts are per-request state indexed by request-pool row
(:class:`TokenCounts`): reset by the host at admission, counted on the
device after each sampled token (so a multi-step launch counts between its
steps). Row 0 is padding: a padded row reads it under the neutral pads of
:data:`PENALTY_FIELDS` (1 / 0 / 0, no bias) and records nothing there.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphrunner.declare.buffers import BufferSpec, PadRule
from graphrunner.pools.checks import DeviceLike
from graphrunner.sampling.min_tokens import HOLD_FIELDS, hold_tensors
from graphrunner.sampling.params import MAX_LOGIT_BIAS, SamplingParams, check_logit_bias

__all__ = [
    "PENALTY_FIELDS",
    "PENALTY_FIELD_NAMES",
    "TokenCounts",
    "penalize",
    "penalty_tensors",
]

#: The per-request penalty buffers: three ``[bs]`` float32 penalties, the
#: logit bias as ``[bs, MAX_LOGIT_BIAS]`` token ids and values, and the
#: ``min_tokens`` hold (:data:`~graphrunner.sampling.min_tokens.HOLD_FIELDS`).
#: Padded rows (and a live row's unused bias columns) are neutral: penalties
#: 1 / 0 / 0, bias 0 on token 0, nothing held.
PENALTY_FIELDS: tuple[BufferSpec, ...] = (
    BufferSpec("repetition_penalty", torch.float32, PadRule.FILL, fill_value=1.0),
    BufferSpec("presence_penalty", torch.float32, PadRule.ZERO),
    BufferSpec("frequency_penalty", torch.float32, PadRule.ZERO),
    BufferSpec("logit_bias_ids", torch.int64, PadRule.ZERO, extra_shape=(MAX_LOGIT_BIAS,)),
    BufferSpec("logit_bias_values", torch.float32, PadRule.ZERO, extra_shape=(MAX_LOGIT_BIAS,)),
    *HOLD_FIELDS,
)
PENALTY_FIELD_NAMES: tuple[str, ...] = tuple(s.name for s in PENALTY_FIELDS)


def penalty_tensors(
    params: Sequence[SamplingParams],
    device: torch.device | str,
    holds: Sequence[tuple[int, Sequence[int]]] | None = None,
) -> dict[str, torch.Tensor]:
    """The live rows of :data:`~graphrunner.sampling.PENALTY_FIELDS` for
    ``n`` requests: the three penalties float32 ``[n]``; ``logit_bias_ids``
    int64 and ``logit_bias_values`` float32 ``[n, MAX_LOGIT_BIAS]`` (unused
    columns: token 0, bias 0); the ``min_tokens`` hold of each request from
    ``holds`` (``(hold_until, end token ids)`` each, see
    :func:`~graphrunner.sampling.min_tokens.hold_tensors`; None: nothing held)."""
    if holds is not None and len(holds) != len(params):
        raise ValueError(
            f"penalty_tensors: {len(params)} params but {len(holds)} holds; expected one each"
        )
    ids = torch.zeros(len(params), MAX_LOGIT_BIAS, dtype=torch.int64)
    values = torch.zeros(len(params), MAX_LOGIT_BIAS)
    for i, p in enumerate(params):
        pairs = check_logit_bias(p.logit_bias)
        ids[i, : len(pairs)] = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
        values[i, : len(pairs)] = torch.tensor([v for _, v in pairs])
    columns = {
        "repetition_penalty": torch.tensor([p.repetition_penalty for p in params]),
        "presence_penalty": torch.tensor([p.presence_penalty for p in params]),
        "frequency_penalty": torch.tensor([p.frequency_penalty for p in params]),
        "logit_bias_ids": ids,
        "logit_bias_values": values,
        **hold_tensors(holds if holds is not None else [(0, ())] * len(params), "cpu"),
    }
    return {s.name: columns[s.name].to(device=device, dtype=s.dtype) for s in PENALTY_FIELDS}


class TokenCounts:
    """Per request-pool row: the output tokens' counts and the prompt's tokens.

    Args:
        num_rows: rows of the request pool's ``req_to_token`` (its size + 1;
            row 0 is padding).
        vocab: the vocabulary size (the logits' last dim).
        device: where the tables live (the forward's device).

    Attributes:
        FIELDS: the step's buffers of the penalties (:data:`PENALTY_FIELDS`).
        counts: int32 ``[num_rows, vocab]``, how often each token was generated.
        prompt: bool ``[num_rows, vocab]``, whether the prompt holds the token.
    """

    FIELDS = PENALTY_FIELDS

    def __init__(self, num_rows: int, vocab: int, device: DeviceLike) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 2:
            raise ValueError(f"num_rows={num_rows!r}; expected an int >= 2 (row 0 is padding)")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"vocab={vocab!r}; expected an int >= 1")
        self.vocab = vocab
        self.counts = torch.zeros(num_rows, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)

    def reset(self, row: int, prompt: Sequence[int]) -> None:
        """Start row ``row`` afresh for a request of ``prompt`` (token ids):
        no output yet, its prompt's tokens marked. Host side, at admission,
        on the current stream (after any queued step still recording there)."""
        rows = self.counts.shape[0]
        if isinstance(row, bool) or not isinstance(row, int) or not 1 <= row < rows:
            raise ValueError(f"reset: row={row!r}; expected an int in 1..{rows - 1} (0 is padding)")
        ids = torch.tensor(list(prompt), dtype=torch.int64)
        if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < self.vocab):
            raise ValueError(f"reset: prompt holds a token outside [0, {self.vocab})")
        self.counts[row].zero_()
        self.prompt[row].zero_()
        self.prompt[row].index_fill_(0, ids.to(self.prompt.device, non_blocking=True), True)

    def record(self, req_pool_indices: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count ``tokens`` (int64 ``[n]``) at rows ``req_pool_indices``
        (int64 ``[n]``), on the device, graph-safe; row 0 (padding, or a row
        that took no step) adds nothing, so it never changes."""
        live = (req_pool_indices != 0).to(torch.int32)
        safe = torch.where(live.bool(), tokens, torch.zeros_like(tokens))
        self.counts.index_put_((req_pool_indices, safe), live, accumulate=True)


def penalize(
    logits: torch.Tensor, counts: TokenCounts, req_pool_indices: torch.Tensor, b: Any
) -> torch.Tensor:
    """``logits`` (float ``[n, V]``) with the bias and penalties of the rows
    at ``req_pool_indices`` (int64 ``[n]``) applied (see the module): float32
    ``[n, V]``, equal to ``logits`` on a row whose parameters are neutral.
    ``b`` holds :data:`PENALTY_FIELDS` by name (a mapping, or a step's view):
    penalties float32 ``[n]``, bias ids int64 and values float32 ``[n, B]``."""
    get = b.__getitem__ if isinstance(b, Mapping) else functools.partial(getattr, b)
    ids = get("logit_bias_ids")
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(-1).expand_as(ids)
    # index_put, not scatter_add: scatter_add's size checks (index rows <= the
    # logits' rows) would be shape guards that keep a saved program from loading.
    x = logits.to(torch.float32).index_put((rows, ids), get("logit_bias_values"), accumulate=True)
    count = counts.counts.index_select(0, req_pool_indices)
    out = count > 0
    seen = out | counts.prompt.index_select(0, req_pool_indices)
    rep = torch.where(seen, get("repetition_penalty").unsqueeze(-1), torch.ones_like(x))
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - get("frequency_penalty").unsqueeze(-1) * count
    return x - get("presence_penalty").unsqueeze(-1) * out
