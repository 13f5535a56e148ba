"""The sampler's distribution against transformers' warpers, greedy rows
against argmax bit for bit, and a row's token independent of its batch."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from graphrunner.sampling import filtered_probs, logprobs, sample

I64 = torch.int64


def hf_probs(row: torch.Tensor, t: float, k: int, p: float, m: float) -> torch.Tensor:
    """transformers' warpers in the order generate() applies them, each only
    when it is not neutral (as generate() builds its list), then a softmax."""
    scores = row[None].clone()
    ids = torch.zeros(1, 1, dtype=I64)
    if t == 0:
        return torch.zeros_like(row).scatter(0, row.argmax(), 1.0)
    if t != 1.0:
        scores = TemperatureLogitsWarper(t)(ids, scores)
    if k != 0:
        scores = TopKLogitsWarper(k)(ids, scores)
    if p < 1.0:
        scores = TopPLogitsWarper(p)(ids, scores)
    if m > 0:
        scores = MinPLogitsWarper(m)(ids, scores)
    return torch.softmax(scores[0], dim=-1)


def random_mix(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Logits of varied sharpness and a mix of every parameter's edges."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.3, 1.0, 3.0, 8.0])[torch.randint(0, 4, (n, 1), generator=g)]
    logits = torch.randn(n, vocab, generator=g) * scale

    def pick(options: list[float]) -> torch.Tensor:
        return torch.tensor(options)[torch.randint(0, len(options), (n,), generator=g)]

    temperature = pick([0.0, 0.25, 0.7, 1.0, 1.0, 1.5, 4.0])
    top_k = pick([0, 0, 1, 2, 5, 17, vocab, vocab + 9]).to(I64)
    top_p = pick([1.0, 1.0, 0.02, 0.3, 0.5, 0.8, 0.95, 0.999])
    min_p = pick([0.0, 0.0, 0.01, 0.1, 0.3, 0.7, 1.0])
    return logits, temperature, top_k, top_p, min_p


@pytest.mark.parametrize(("vocab", "seed"), [(40, 0), (257, 1), (3, 2)])
def test_filtered_distribution_equals_transformers_warpers_in_order(vocab, seed):
    n = 400
    logits, t, k, p, m = random_mix(n, vocab, seed)
    got = filtered_probs(logits, t, k, p, m)
    assert got.shape == (n, vocab) and got.dtype == torch.float32
    for i in range(n):
        params = (float(t[i]), int(k[i]), float(p[i]), float(m[i]))
        want = hf_probs(logits[i], *params)
        where = f"row {i}: (T, k, p, min_p) = {params}"
        assert torch.equal(got[i] > 0, want > 0), where  # the same tokens kept
        assert torch.allclose(got[i], want, atol=2e-6, rtol=1e-4), where


def test_temperature_zero_is_argmax_bit_for_bit_with_ties():
    g = torch.Generator().manual_seed(3)
    vocab = 33
    logits = torch.randint(-3, 4, (256, vocab), generator=g).to(torch.bfloat16)  # many ties
    logits[0] = 0  # every token tied
    logits[1, -1] = 100  # the maximum in the last column
    _, _, k, p, m = random_mix(256, vocab, 4)
    zero = torch.zeros(256)
    seed = torch.randint(0, 2**62, (256,), generator=g)
    tokens = sample(logits, zero, k, p, m, seed, torch.arange(256))
    assert tokens.dtype == I64
    assert torch.equal(tokens, logits.argmax(-1))
    probs = filtered_probs(logits, zero, k, p, m)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), zero + 1)


def test_sampled_token_lies_in_the_filtered_support():
    logits, t, k, p, m = random_mix(2000, 64, 5)
    seed = torch.arange(2000) * 7919
    tokens = sample(logits, t, k, p, m, seed, torch.arange(2000))
    probs = filtered_probs(logits, t, k, p, m)
    assert (probs.gather(-1, tokens[:, None]) > 0).all()


def test_same_seed_and_position_same_token_whatever_the_batch():
    n, vocab = 96, 50
    logits, t, k, p, m = random_mix(n, vocab, 6)
    t = torch.where(t == 0, 1.0, t)  # every row samples
    g = torch.Generator().manual_seed(7)
    seed = torch.randint(0, 2**63 - 1, (n,), generator=g)
    position = torch.randint(0, 4096, (n,), generator=g)
    full = sample(logits, t, k, p, m, seed, position)
    alone = torch.cat(
        [
            sample(logits[i : i + 1], t[i : i + 1], k[i : i + 1], p[i : i + 1], m[i : i + 1],
                   seed[i : i + 1], position[i : i + 1])
            for i in range(n)
        ]
    )  # fmt: skip
    assert torch.equal(full, alone)
    perm = torch.randperm(n, generator=g)
    shuffled = sample(logits[perm], t[perm], k[perm], p[perm], m[perm], seed[perm], position[perm])
    assert torch.equal(shuffled, full[perm])
    # Padded up with rows at the pad values: the live rows do not move.
    pad = 37
    padded = sample(
        torch.cat([logits, torch.randn(pad, vocab, generator=g)]),
        torch.cat([t, torch.ones(pad)]),
        torch.cat([k, torch.ones(pad, dtype=I64)]),
        torch.cat([p, torch.ones(pad)]),
        torch.cat([m, torch.zeros(pad)]),
        torch.cat([seed, torch.zeros(pad, dtype=I64)]),
        torch.cat([position, torch.zeros(pad, dtype=I64)]),
    )
    assert torch.equal(padded[:n], full)
    # Another seed, another position or another draw changes most tokens.
    flat = torch.zeros(n, vocab)  # uniform over 50 tokens: a repeat is 1 in 50
    one, zero, kk = torch.ones(n), torch.zeros(n), torch.zeros(n, dtype=I64)
    base = sample(flat, one, kk, one, zero, seed, position)
    for other in (
        sample(flat, one, kk, one, zero, seed + 1, position),
        sample(flat, one, kk, one, zero, seed, position + 1),
        sample(flat, one, kk, one, zero, seed, position, draw=1),
    ):
        assert (other == base).sum() < n // 5


def test_logprobs_are_the_unfiltered_softmax_of_the_raw_logits():
    logits, t, k, p, m = random_mix(64, 100, 8)
    logits = logits.to(torch.bfloat16)
    tokens = sample(logits, t, k, p, m, torch.arange(64), torch.zeros(64, dtype=I64))
    out = logprobs(logits, tokens, 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.chosen.shape == (64,) and out.top.shape == (64, 5) and out.top_ids.shape == (64, 5)
    assert torch.allclose(out.chosen.double(), ref.gather(-1, tokens[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(out.top.double(), ref.gather(-1, out.top_ids), atol=1e-5)
    assert torch.allclose(out.top.double(), ref.topk(5, dim=-1).values, atol=1e-5)
    assert (out.top[:, :-1] >= out.top[:, 1:]).all()
    assert logprobs(logits, tokens, 0).top.shape == (64, 0)
    for bad in (-1, 101, True, 2.0):
        with pytest.raises(ValueError, match=f"n={bad!r}; expected an int in \\[0, 100\\]"):
            logprobs(logits, tokens, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
def test_a_parameter_that_is_not_a_number_never_indexes_out_of_range(field: str) -> None:
    # Validated parameters never get here; a row of NaN (a tail nobody
    # rewrote) must still give a token of the vocabulary, not a crash.
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    params = {
        "temperature": torch.ones(3),
        "top_k": torch.zeros(3, dtype=torch.int64),
        "top_p": torch.ones(3),
        "min_p": torch.zeros(3),
    }
    params[field] = torch.full((3,), float("nan"))
    seed, position = torch.arange(3), torch.arange(3)
    tokens = sample(logits, **params, seed=seed, position=position)
    assert tokens.dtype == torch.int64 and bool(((tokens >= 0) & (tokens < 11)).all())
