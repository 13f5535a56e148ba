"""Speculative rejection sampling is exact: over 12,000 independent seeds (a
fixed list, so a run cannot flake), the token emitted at each column, among
the rows that reach it, follows the target's filtered distribution (chi-square
against ``filtered_probs`` computed on its own), for each filter alone and
combined; drafts drawn from ``q == p`` always hold; temperature 0 is the
greedy rule bit for bit; a row's tokens depend on its seed alone."""

from __future__ import annotations

import pytest
import torch
from test_sampling_distribution import chi_square_critical

from graphrunner.sampling import draft_sample, filtered_probs, rejection_sample

N, V, K = 12_000, 7, 3
START = 40  # the position of the first draft

CASES = {
    "temperature": dict(temperature=1.3),
    "top_k": dict(temperature=0.9, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.7),
    "min_p": dict(temperature=1.1, min_p=0.15),
    "combined": dict(temperature=1.2, top_k=5, top_p=0.9, min_p=0.05),
}


def _rows(n: int, **params: float) -> dict[str, torch.Tensor]:
    def full(name: str, default: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((n,), params.get(name, default), dtype=dtype)

    return {
        "temperature": full("temperature", 0.0, torch.float32),
        "top_k": full("top_k", 0, torch.int64),
        "top_p": full("top_p", 1.0, torch.float32),
        "min_p": full("min_p", 0.0, torch.float32),
        "sampling_seed": torch.arange(n, dtype=torch.int64) * 7919 + 12345,
    }


def _logits(seed: int, scale: float = 1.2) -> torch.Tensor:
    """``[K + 1, V]``: one row per column, shared by every request."""
    return torch.randn(K + 1, V, generator=torch.Generator().manual_seed(seed)) * scale


def _draw(
    target: torch.Tensor, draft: torch.Tensor, rows: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(drafts ``[N, K]``, tokens ``[N, K + 1]``, accepted ``[N]``) of one round."""
    n = rows["sampling_seed"].shape[0]
    positions = torch.full((n,), START, dtype=torch.int64)
    drafts, qs = [], []
    for j in range(K):
        token, q = draft_sample(draft[j].expand(n, V), rows, positions + j)
        drafts.append(token)
        qs.append(q)
    d = torch.stack(drafts, 1)
    tokens, accepted = rejection_sample(
        target.expand(n, K + 1, V), d, torch.stack(qs, 1), rows, positions
    )
    return d, tokens, accepted


def _emitted(drafts: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor, j: int):
    """The token emitted at column ``j`` by the rows that reach it."""
    reach = accepted >= j
    token = torch.where(accepted[reach] > j, drafts[reach, j] if j < K else -1, tokens[reach, j])
    return token


def _check(counts: torch.Tensor, probs: torch.Tensor, where: str) -> None:
    n = int(counts.sum())
    assert n >= 1000, f"{where}: only {n} draws"
    support = probs > 0
    assert int(counts[~support].sum()) == 0, f"{where}: drew a filtered token {counts}"
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    critical = chi_square_critical(max(int(support.sum()) - 1, 1))
    assert chi2 < critical, f"{where}: chi2 {chi2:.1f} >= {critical:.1f}; {counts / n} vs {probs}"


@pytest.mark.parametrize("case", list(CASES))
def test_every_column_follows_the_target_distribution(case: str):
    params = CASES[case]
    rows = _rows(N, **params)
    target = _logits(1)
    draft = target + _logits(2, scale=0.6)  # a draft that mostly agrees, as a good one does
    drafts, tokens, accepted = _draw(target, draft, rows)
    one = _rows(1, **params)
    p = filtered_probs(
        target, *(one[n].expand(K + 1) for n in ("temperature", "top_k", "top_p", "min_p"))
    )
    for j in range(K + 1):  # the target's logits at a column do not depend on the earlier ones
        token = _emitted(drafts, tokens, accepted, j)
        _check(torch.bincount(token, minlength=V).double(), p[j].double(), f"{case} column {j}")
    assert 0 < int(accepted.sum()) < K * N  # some drafts hold, some are resampled


def test_drafts_drawn_from_the_target_itself_always_hold():
    rows = _rows(N, temperature=1.0, top_p=0.9)
    target = _logits(3)
    _, _, accepted = _draw(target, target, rows)
    assert bool((accepted == K).all())


def test_temperature_0_is_the_greedy_rule_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    n = 64
    target = torch.randn(n, K + 1, V, generator=gen)
    argmax = target.argmax(-1)
    drafts = torch.where(torch.rand(n, K, generator=gen) < 0.7, argmax[:, :K], 0)
    rows = _rows(n, temperature=1.0)
    rows["temperature"][::2] = 0.0  # greedy and sampling rows in one batch
    q = torch.softmax(torch.randn(n, K, V, generator=gen), -1)
    tokens, accepted = rejection_sample(target, drafts, q, rows, torch.arange(n))
    greedy = (drafts == argmax[:, :K]).long().cumprod(1).sum(1)
    assert torch.equal(tokens[::2], argmax[::2])
    assert torch.equal(accepted[::2], greedy[::2])


def test_a_row_depends_on_its_seed_not_its_company():
    params = CASES["combined"]
    target = _logits(5)
    draft = target + _logits(6, scale=0.6)
    rows = _rows(N, **params)
    big = _draw(target, draft, rows)
    for lo, hi in ((0, 1), (17, 30), (N - 5, N)):
        part = {n: t[lo:hi] for n, t in rows.items()}
        small = _draw(target, draft, part)
        for a, b in zip(big, small, strict=True):
            assert torch.equal(a[lo:hi], b)
    other = dict(rows, sampling_seed=rows["sampling_seed"] + 1)
    assert not torch.equal(_draw(target, draft, other)[1], big[1])  # other seeds, other tokens


def test_deterministic_drafts_stay_exact():
    """No ``q`` (drafts taken, not drawn): their one-hot is ``q``, still exact."""
    rows = _rows(N, temperature=1.0, top_k=5)
    target = _logits(7)
    drafts = torch.randint(0, V, (N, K), generator=torch.Generator().manual_seed(8))
    positions = torch.full((N,), START, dtype=torch.int64)
    tokens, accepted = rejection_sample(target.expand(N, K + 1, V), drafts, None, rows, positions)
    one = _rows(1, temperature=1.0, top_k=5)
    p = filtered_probs(target[:1], one["temperature"], one["top_k"], one["top_p"], one["min_p"])[0]
    token = torch.where(accepted > 0, drafts[:, 0], tokens[:, 0])
    _check(torch.bincount(token, minlength=V).double(), p.double(), "one-hot q, column 0")
