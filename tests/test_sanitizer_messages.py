"""The sanitizer's messages stay one line whatever the output's size: a
non-finite output is reported by count and first positions, not printed."""

from __future__ import annotations

import pytest
import torch

from graphrunner import PaddingViolation
from graphrunner.sanitizer.checks import check_finite


def test_a_non_finite_output_is_reported_by_count_and_first_positions() -> None:
    logits = torch.zeros(3, 32_000)
    logits[1, 5], logits[1, 7], logits[2, 0] = float("nan"), float("inf"), float("-inf")
    with pytest.raises(PaddingViolation) as caught:
        check_finite({"logits": logits})
    message = str(caught.value)
    assert message == (
        "output 'logits' batch row 1 is not finite: 3 of 96000 values, "
        "first at [(1, 5), (1, 7), (2, 0)]"
    )
    assert len(message) < 200  # the row is not printed
