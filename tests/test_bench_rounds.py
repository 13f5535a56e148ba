"""The pure parts of ``bench/bench_real_cpu.py --rounds``: the order each
round runs its variants in, and ratios taken as the median of per-round
ratios (not the ratio of medians). No model is loaded, nothing compiled."""

from __future__ import annotations

import pytest

from bench import bench_real_cpu
from bench.bench_real_cpu import median_ratio, per_round_ratios, round_order

NAMES = ["transformers", "int4", "llama.cpp"]


def test_round_order_rotates_by_one_each_round() -> None:
    assert round_order(NAMES, 0) == ["transformers", "int4", "llama.cpp"]
    assert round_order(NAMES, 1) == ["int4", "llama.cpp", "transformers"]
    assert round_order(NAMES, 2) == ["llama.cpp", "transformers", "int4"]
    assert round_order(NAMES, 3) == round_order(NAMES, 0)
    assert round_order([], 4) == []


def test_every_variant_goes_first_and_each_round_runs_all_once() -> None:
    orders = [round_order(NAMES, r) for r in range(len(NAMES))]
    assert sorted(o[0] for o in orders) == sorted(NAMES)
    assert all(sorted(o) == sorted(NAMES) for o in orders)
    # Each variant takes every position once over len(NAMES) rounds.
    for name in NAMES:
        assert sorted(o.index(name) for o in orders) == list(range(len(NAMES)))
    assert NAMES == ["transformers", "int4", "llama.cpp"]  # the input is not rotated in place


def test_ratio_is_the_median_of_per_round_ratios_not_of_medians() -> None:
    # The machine runs twice as fast in round 2: the per-round ratio stays 2.
    variant = [20.0, 40.0, 21.0]
    baseline = [10.0, 20.0, 30.0]
    assert per_round_ratios(variant, baseline) == [2.0, 2.0, 0.7]
    assert median_ratio(variant, baseline) == pytest.approx(2.0)
    # The ratio of the medians would read 21 / 20.
    assert median_ratio(variant, baseline) != pytest.approx(21.0 / 20.0)
    # An even count: the mean of the two middle ratios.
    assert median_ratio([3.0, 8.0], [1.0, 2.0]) == pytest.approx(3.5)


def test_ratios_refuse_rounds_that_do_not_pair() -> None:
    with pytest.raises(ValueError, match="3 rounds against a baseline of 2"):
        per_round_ratios([1.0, 2.0, 3.0], [1.0, 2.0])


@pytest.mark.parametrize(
    ("option", "bad", "says"),
    [
        ("--rounds", "0", "expected a whole number >= 1, got '0'"),
        ("--rounds", "-2", "expected a whole number >= 1, got '-2'"),
        ("--rounds", "two", "expected a whole number >= 1, got 'two'"),
        # One new token has no decode step to time.
        ("--new", "1", "expected a whole number >= 2, got '1'"),
        ("--batches", "8,x", "in '8,x': expected a whole number >= 1, got 'x'"),
        ("--batches", "0", "in '0': expected a whole number >= 1, got '0'"),
    ],
)
def test_bad_numbers_refused_by_value(
    option: str, bad: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_real_cpu.main(["--variants", "int4", option, bad])
    assert stop.value.code == 2
    assert f"argument {option}: {says}" in capsys.readouterr().err


class _Fake:
    """A contender whose round k decodes at ``base + k`` tok/s and logs its turns."""

    def __init__(self, name: str, base: float, log: list[str]) -> None:
        self.who, self.name, self.base, self.log, self.runs = name, name, base, log, 0

    def decode(self) -> tuple[float, list[list[int]]]:
        self.log.append(self.name)
        self.runs += 1
        return self.base + self.runs - 1, [[self.runs]]

    def close(self) -> None:
        pass


def test_alternate_runs_each_contender_once_a_round_in_the_rotated_order() -> None:
    log: list[str] = []
    fakes = {n: _Fake(n, b, log) for n, b in [("a", 10.0), ("b", 20.0), ("c", 30.0)]}
    figures, tokens, orders = bench_real_cpu.alternate(fakes, 4)
    assert orders == [round_order(list(fakes), r) for r in range(4)]
    assert log == [n for order in orders for n in order]
    assert figures == {"a": [10, 11, 12, 13], "b": [20, 21, 22, 23], "c": [30, 31, 32, 33]}
    assert tokens["b"] == [[[1]], [[2]], [[3]], [[4]]]


def test_ab_summary_takes_the_median_of_per_round_ratios_and_checks_each_ones_tokens() -> None:
    log: list[str] = []
    fakes = {"old": _Fake("old", 10.0, log), "new": _Fake("new", 30.0, log)}
    figures, tokens, _ = bench_real_cpu.alternate(fakes, 3)
    summary = bench_real_cpu.ab_summary(figures, tokens, "new", "old")
    assert summary["rounds"] == 3
    assert summary["median"] == {"old": 11, "new": 31}
    assert summary["ratio"] == 31 / 11  # rounds 30/10, 31/11, 32/12: the middle one
    assert summary["tokens_per_s"] == figures
    # The fakes' tokens change every round.
    assert summary["same_tokens_every_round"] is False
    steady = {n: [[[1]]] * 3 for n in figures}
    assert bench_real_cpu.ab_summary(figures, steady, "new", "old")["same_tokens_every_round"]
