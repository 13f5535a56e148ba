"""The pure parts of ``bench/bench_agreement.py``'s free-running section:
where each row first leaves the reference's tokens, the reference's own
logit margin there, and the count of near ties. No model is loaded."""

from __future__ import annotations

import torch

from bench.bench_agreement import divergences, margin_counts, top_margins


def _logits() -> tuple[list[torch.Tensor], list[slice]]:
    """Two prompts of 2 tokens, 3 new tokens each, vocabulary of 4: position
    ``1 + i`` predicts new token ``i``."""
    first = torch.zeros(4, 4)
    first[1] = torch.tensor([0.0, 2.0, 1.5, 0.0])  # picks 1, 2 is 0.5 behind
    first[2] = torch.tensor([3.0, 0.0, 0.0, 2.8])
    first[3] = torch.tensor([0.0, 0.0, 0.0, 1.0])
    second = torch.zeros(4, 4)
    second[1:, 2] = 1.0
    return [first, second], [slice(1, 4), slice(1, 4)]


def test_each_row_that_leaves_gives_its_first_token_and_the_references_margin() -> None:
    logits, at = _logits()
    reference = [[1, 0, 3], [2, 2, 2]]
    got = divergences([[1, 3, 0], [2, 2, 2]], reference, logits, at)
    assert got["rows_equal"] == 1 and got["leading"] == (1 + 3) / 2
    ((row, token, margin),) = got["first_divergences"]
    assert (row, token) == (0, 1) and abs(margin - 0.2) < 1e-6  # 3.0 against 2.8

    got = divergences([[2, 0, 3], [2, 2, 2]], reference, logits, at)
    assert got["first_divergences"] == [(0, 0, 0.5)] and got["leading"] == 1.5


def test_no_divergence_when_every_row_agrees() -> None:
    logits, at = _logits()
    reference = [[1, 0, 3], [2, 2, 2]]
    got = divergences(reference, reference, logits, at)
    assert got == {"rows_equal": 2, "leading": 3.0, "first_divergences": []}


def test_near_ties_are_counted_under_each_bound() -> None:
    logits, at = _logits()
    margins = top_margins(logits, at)
    assert torch.allclose(margins, torch.tensor([0.5, 0.2, 1.0, 1.0, 1.0, 1.0]))
    counts = margin_counts(margins)
    assert counts["positions"] == 6
    assert counts["below"] == {"0.1": 0, "0.25": 1, "0.5": 1}
