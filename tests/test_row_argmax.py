"""``row_argmax``: a row's greedy token in two passes of max, ``argmax`` bit for bit."""

from __future__ import annotations

import pytest
import torch

from graphrunner.sampling import row_argmax
from graphrunner.sampling.argmax import BLOCK


@pytest.mark.parametrize("vocab", [2 * BLOCK, 3 * BLOCK + 1, 1000, 49152, 49155])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_is_argmax_with_ties_nan_and_infinities(vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab)
    # Few distinct values: many ties, across blocks and within one.
    x = torch.randint(-4, 4, (9, vocab), generator=g).to(dtype)
    x[1, -1] = 9  # the maximum in the last (shorter) block
    x[2, [5, BLOCK + 5, vocab - 1]] = 9  # equal maxima in several blocks: the first
    x[3, 7] = float("nan")  # a NaN counts as the maximum
    x[3, vocab - 2] = float("nan")
    x[4] = float("-inf")  # every value equal
    x[5, 0] = float("inf")
    x[6, BLOCK - 1], x[6, BLOCK] = 9, 9  # either side of a block's edge
    x[7] = -0.0
    x[7, 3] = 0.0  # equal to -0.0: the first index
    assert torch.equal(row_argmax(x), x.argmax(-1))


def test_a_short_row_and_a_view_take_argmax_itself() -> None:
    x = torch.randn(3, 2 * BLOCK + 7)
    assert torch.equal(row_argmax(x[:, :BLOCK]), x[:, :BLOCK].argmax(-1))
    view = x.t().contiguous().t()  # a column-major [3, V]
    assert torch.equal(row_argmax(view), view.argmax(-1))
