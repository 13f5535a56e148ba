"""bench/cpu_contention.py: its verdict follows its numbers, and a short
measurement runs and leaves no busy loop behind."""

from __future__ import annotations

import os

import pytest

from bench.cpu_contention import PRODUCTS, measure, report

STEP = "decode step --quantize int4-q8"


def _result(product_slowdown: float, step_slowdown: float) -> dict[str, dict[str, float]]:
    rows = {name: {"idle": 1.0, "CPU 1": product_slowdown} for name in PRODUCTS}
    return {**rows, STEP: {"idle": 6.0, "CPU 1": 6.0 * step_slowdown}}


def test_the_verdict_names_a_slowed_step_and_independent_arithmetic():
    lines = report(_result(1.04, 1.49), ["--rounds", "1"])
    verdict = lines[-2]
    assert "the products alone slow at most 1.04x" in verdict
    assert "arithmetic is independent" in verdict
    assert f"A whole {STEP} slows 1.49x" in verdict
    assert f"| {STEP} | CPU 1 running a Python loop | 8.940 | 1.49x |" in lines


def test_the_verdict_says_when_the_cpus_share_a_core_and_a_step_keeps_its_speed():
    verdict = report(_result(1.6, 1.1), ["--rounds", "1"])[-2]
    assert "the CPUs share a core" in verdict
    assert f"A whole {STEP} keeps its speed (1.10x)" in verdict


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_short_measurement_times_every_product_beside_each_other_cpu():
    cpus = sorted(os.sched_getaffinity(0))
    try:
        result = measure(cpus, rounds=1, calls=1)
    finally:
        os.sched_setaffinity(0, set(cpus))  # the test process's CPUs back
    assert set(result) == set(PRODUCTS)
    for times in result.values():
        assert set(times) == {"idle", *(f"CPU {c}" for c in cpus[1:])}
        assert all(ms > 0 for ms in times.values())
