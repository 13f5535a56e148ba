"""A token batch's attention (:func:`~graphrunner_ref.model.attention_tokens.token_batch_attention`):
each request's tokens attend over its own slots exactly as the prompt
attention of that request alone would (the same call, so the same bits),
padded requests own no token, and the tokens past the live ones (a step
padded up to its captured size) come out zero whatever their queries hold;
a request owning every token of the step gets its output as is."""

from __future__ import annotations

import pytest
import torch

from graphrunner_ref.model.attention_tokens import (
    TokenLayout,
    prompt_attention,
    token_batch_attention,
)

HEADS, KV_HEADS, DIM, SLOTS, ROWS, CONTEXT = 6, 2, 64, 200, 5, 64


def _world(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(SLOTS, KV_HEADS, DIM, generator=gen).to(dtype)
    req_to_token = torch.zeros(ROWS, CONTEXT, dtype=torch.int32)
    for row in range(1, ROWS):  # row 0 the padded requests' all-zero row
        req_to_token[row] = torch.randperm(SLOTS - 1, generator=gen)[:CONTEXT].int() + 1
    return k, v, req_to_token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("extend", "lengths", "tokens"),
    [
        ([7, 0, 3, 1], [20, 1, 3, 40], 11),  # a prompt chunk, a padded request, decode rows
        ([5, 2, 0, 0], [5, 30, 1, 1], 16),  # padded tokens after the live ones
        ([12, 0, 0, 0], [12, 1, 1, 1], 12),  # one request owns every token
    ],
)
def test_each_request_attends_as_alone_and_padded_tokens_are_zero(
    dtype: torch.dtype, extend: list[int], lengths: list[int], tokens: int
) -> None:
    k, v, req_to_token = _world(dtype)
    rows = torch.tensor([i + 1 if n else 0 for i, n in enumerate(extend)])  # padded: row 0
    q = torch.randn(tokens, HEADS, DIM, generator=torch.Generator().manual_seed(4)).to(dtype)
    live = sum(extend)
    q[live:] = float("nan")  # padded tokens: whatever they hold stays out
    layout = TokenLayout(req_to_token, rows, torch.tensor(lengths), torch.tensor(extend))
    got = token_batch_attention(q, k, v, layout, 0.125)
    assert got.shape == (tokens, HEADS * DIM) and got.dtype == dtype
    attend = prompt_attention(q, k, None)
    start = 0
    for i, (n, length) in enumerate(zip(extend, lengths, strict=True)):
        if n == 0:
            continue
        slots = req_to_token[int(rows[i]), :length].long()
        alone = attend(q[start : start + n], k, v, slots, 0.125, None)
        assert torch.equal(got[start : start + n], alone), i
        start += n
    assert torch.equal(got[live:], torch.zeros_like(got[live:]))
