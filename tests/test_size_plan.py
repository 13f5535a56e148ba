"""The capture-size optimiser: the issue's reference figures, and the exact
optimum against brute force over every list (sizes.padding_waste on the
expanded trace is the oracle, independent of the optimiser's arithmetic)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphrunner.sizing.plan import budget_capture_sizes, expected_waste, optimal_capture_sizes
from graphrunner.sizing.sizes import default_capture_sizes, padding_waste

#: Integer steps per size; 10**9 keeps the exp trace's figures to 8 digits.
SCALE = 10**9


def _percent(x: float) -> float:
    return round(100 * x, 2)


def _uniform() -> dict[int, int]:
    return dict.fromkeys(range(1, 257), 1)


def _decaying() -> dict[int, int]:
    return {b: round(SCALE * math.exp(-b / 24)) for b in range(1, 257)}


def test_default_list_is_36_graphs_up_to_256():
    sizes = default_capture_sizes(256)
    assert len(sizes) == 36 and sizes[:5] == [1, 2, 4, 8, 12] and sizes[-1] == 256


@pytest.mark.parametrize(
    ("counts", "default", "optimum"), [(_uniform(), 2.54, 2.33), (_decaying(), 9.14, 3.58)]
)
def test_reference_figures_padded_over_computed_rows(counts, default, optimum):
    plan = optimal_capture_sizes(counts, 36, max_bs=256)
    assert len(plan.sizes) == 36 and plan.sizes[-1] == 256
    assert _percent(expected_waste(default_capture_sizes(256), counts).fraction) == default
    assert _percent(plan.waste.fraction) == optimum
    assert plan.waste == expected_waste(plan.sizes, counts)


def test_peaked_traffic_pads_nothing_with_enough_graphs():
    counts = {b: round(SCALE * math.exp(-(((b - 100) / 3) ** 2))) for b in range(1, 257)}
    counts = {b: n for b, n in counts.items() if n}
    plan = optimal_capture_sizes(counts, 36, max_bs=256)
    assert plan.waste.padded_rows == 0
    assert expected_waste(default_capture_sizes(256), counts).fraction > 0.02
    # Fewer graphs than peak sizes: still far below the default's padding.
    assert optimal_capture_sizes(counts, 8, max_bs=256).waste.fraction < 0.01


def test_fewer_sizes_when_more_would_not_pad_less():
    plan = optimal_capture_sizes({3: 5, 7: 1}, 10)
    assert plan.sizes == (3, 7) and plan.waste.padded_rows == 0
    plan = optimal_capture_sizes({3: 5, 7: 1}, 10, max_bs=16)
    assert plan.sizes == (3, 7, 16)


def test_batches_above_max_bs_run_eagerly_unpadded():
    plan = optimal_capture_sizes({2: 1, 5: 1, 40: 3}, 1, max_bs=8)
    assert plan.sizes == (8,)
    assert plan.waste.live_rows == 2 + 5 + 120 and plan.waste.padded_rows == 6 + 3


def _brute(counts: dict[int, int], graphs: int, top: int, pool: list[int], nbytes=None, budget=0):
    """Min padded rows over every list from ``pool`` ending at ``top``."""
    trace = [bs for bs, n in counts.items() for _ in range(n)]
    below = [s for s in pool if s < top]
    best = None
    for r in range(min(graphs, len(below) + 1)):
        for combo in itertools.combinations(below, r):
            sizes = [*combo, top]
            if nbytes is not None and sum(nbytes[s] for s in sizes) > budget:
                continue
            padded = padding_waste(sizes, trace).padded_rows
            cost = sum(nbytes[s] for s in sizes) if nbytes is not None else 0
            if best is None or (padded, cost) < best:
                best = (padded, cost)
    return best


_counts = st.dictionaries(st.integers(1, 12), st.integers(1, 6), min_size=1, max_size=8)


@settings(max_examples=150, deadline=None)
@given(counts=_counts, graphs=st.integers(1, 5), extra=st.integers(0, 3))
def test_optimum_equals_brute_force_over_every_size(counts, graphs, extra):
    top = max(counts) + extra
    plan = optimal_capture_sizes(counts, graphs, max_bs=top)
    # The oracle tries every size 1..top, not only the served ones.
    padded, _ = _brute(counts, graphs, top, list(range(1, top + 1)))
    assert plan.waste.padded_rows == padded
    assert len(plan.sizes) <= graphs and plan.sizes[-1] == top
    assert list(plan.sizes) == sorted(set(plan.sizes))
    trace = [bs for bs, n in counts.items() for _ in range(n)]
    assert plan.waste == padding_waste(plan.sizes, trace)


@settings(max_examples=150, deadline=None)
@given(
    counts=_counts,
    graphs=st.integers(1, 5),
    report=st.dictionaries(st.integers(1, 14), st.integers(0, 40), min_size=1, max_size=9),
    slack=st.integers(0, 120),
)
def test_budgeted_optimum_equals_brute_force(counts, graphs, report, slack):
    top = max(report)
    budget = report[top] + slack
    plan = budget_capture_sizes(counts, graphs, report, budget)
    padded, cost = _brute(counts, graphs, top, sorted(report), report, budget)
    assert (plan.waste.padded_rows, plan.memory_bytes) == (padded, cost)
    assert set(plan.sizes) <= set(report) and plan.sizes[-1] == top
    assert len(plan.sizes) <= graphs and plan.memory_bytes <= budget
    assert plan.memory_bytes == sum(report[s] for s in plan.sizes)


def test_unbounded_budget_matches_the_unbudgeted_optimum():
    counts = _decaying()
    report = dict.fromkeys(range(1, 65), 10)
    free = budget_capture_sizes(counts, 6, report, 10**9, max_bs=64)
    assert free.waste == optimal_capture_sizes(counts, 6, max_bs=64).waste
    tight = budget_capture_sizes(counts, 6, report, 30, max_bs=64)
    assert len(tight.sizes) == 3 and tight.waste.padded_rows > free.waste.padded_rows


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: optimal_capture_sizes({}, 4), "no steps"),
        (lambda: optimal_capture_sizes({3: 1}, 0), "graphs = 0"),
        (lambda: optimal_capture_sizes({0: 1}, 2), "batch size = 0"),
        (lambda: optimal_capture_sizes({3: -1}, 2), r"counts\[3\] = -1"),
        (lambda: optimal_capture_sizes({3: 1.5}, 2), r"counts\[3\] = 1.5"),
        (lambda: optimal_capture_sizes({3: 2**62}, 2, max_bs=4), "int64"),
        (lambda: budget_capture_sizes({3: 1}, 2, {4: 10}, 10, max_bs=8), "max_bs 8 is not"),
        (lambda: budget_capture_sizes({3: 1}, 2, {4: 10}, 9), "budget 9 bytes is below"),
        (lambda: budget_capture_sizes({3: 1}, 2, {4: -1}, 9), r"size_bytes\[4\] = -1"),
        (lambda: budget_capture_sizes({3: 1}, 2, {}, 9), "size_bytes is empty"),
        (lambda: expected_waste([4, 2], {3: 1}), "sorted and unique"),
    ],
)
def test_bad_inputs_name_the_argument_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()
