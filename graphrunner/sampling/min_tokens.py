"""vLLM's ``min_tokens`` inside the step: a row's end tokens held back.

A request that asks for at least ``m`` new tokens may not draw its end
tokens (the engine's end token, unless it ignores it, and its own stop
tokens) before it holds ``m``. Its ``k``-th new token (``k`` from 0) is drawn
at position ``len(prompt) + k``, so the rule is one comparison per row:
while the drawn token's position is below ``len(prompt) + m`` (the row's
``hold_until``), the logits of the row's ``hold_ids`` are ``-inf``
(:func:`hold_end_tokens`). Both are fixed for the request's life, so the
rows are built once per batch composition, as the penalties' are.

Padded rows hold nothing: ``hold_until`` 0 is below no position, and their
``hold_ids`` 0 are never masked. A live row's unused id columns repeat its
first id (masking one token twice is masking it once).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphrunner.declare.buffers import BufferSpec, PadRule

__all__ = [
    "HOLD_FIELDS",
    "MAX_HOLD_TOKENS",
    "hold_end_tokens",
    "hold_tensors",
]

#: The most end tokens one row holds back (the engine's end token and the
#: request's stop tokens).
MAX_HOLD_TOKENS = 16

#: ``hold_until`` int64 ``[bs]``: the first position at which the end tokens
#: may be drawn (0: never held); ``hold_ids`` int64 ``[bs, MAX_HOLD_TOKENS]``:
#: the tokens held. Padded rows: 0 and 0, nothing held.
HOLD_FIELDS: tuple[BufferSpec, ...] = (
    BufferSpec("hold_until", torch.int64, PadRule.ZERO),
    BufferSpec("hold_ids", torch.int64, PadRule.ZERO, extra_shape=(MAX_HOLD_TOKENS,)),
)


def hold_tensors(
    holds: Sequence[tuple[int, Sequence[int]]], device: torch.device | str
) -> dict[str, torch.Tensor]:
    """The live rows of :data:`HOLD_FIELDS` for ``n`` requests, each given as
    ``(hold_until, end token ids)``: ``hold_until`` int64 ``[n]`` (0 where no
    id is given) and ``hold_ids`` int64 ``[n, MAX_HOLD_TOKENS]``."""
    until = torch.zeros(len(holds), dtype=torch.int64)
    ids = torch.zeros(len(holds), MAX_HOLD_TOKENS, dtype=torch.int64)
    for i, (position, tokens) in enumerate(holds):
        if len(tokens) > MAX_HOLD_TOKENS:
            raise ValueError(
                f"holds[{i}]: {len(tokens)} end tokens; expected at most {MAX_HOLD_TOKENS}"
            )
        if not tokens:
            continue
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"holds[{i}]: hold_until={position!r}; expected an int >= 0")
        until[i] = position
        ids[i] = torch.tensor(list(tokens), dtype=torch.int64)[0]
        ids[i, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.int64)
    return {"hold_until": until.to(device), "hold_ids": ids.to(device)}


def hold_end_tokens(logits: torch.Tensor, position: torch.Tensor, b: Any) -> torch.Tensor:
    """``logits`` (float ``[n, V]``) with ``-inf`` at each row's ``hold_ids``
    where ``position`` (int64 ``[n]``, the drawn token's) is below the row's
    ``hold_until``; other rows unchanged. ``b`` holds :data:`HOLD_FIELDS` by
    name (a mapping or a step's view). Graph-safe: no branch on data."""
    get = b.__getitem__ if isinstance(b, Mapping) else functools.partial(getattr, b)
    ids = get("hold_ids")
    held = (position < get("hold_until")).unsqueeze(-1).expand_as(ids)
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(-1).expand_as(ids)
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    mask = mask.index_put((rows, ids), held)
    return logits.masked_fill(mask, float("-inf"))
