"""The long prompts of ``bench/bench_kv_dtype.py`` and ``bench_real_cpu
--context`` (each chat prompt repeated whole, then cut, to the context), and
their refusals: a variant without a float16 twin, a context that is not a
whole number."""

from __future__ import annotations

import pytest

from bench import bench_kv_dtype
from bench.bench_context import long_prompts


def test_each_prompt_is_repeated_then_cut_to_the_context() -> None:
    got = long_prompts([[1, 2, 3], [4]], 7)
    assert got == [[1, 2, 3, 1, 2, 3, 1], [4] * 7]
    assert long_prompts([[5, 6]], 2) == [[5, 6]]


def test_a_variant_without_a_float16_twin_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_kv_dtype.main(["--variant", "int4"])
    assert stop.value.code == 2
    assert "argument --variant: invalid choice: 'int4'" in capsys.readouterr().err


def test_bench_real_cpu_refuses_a_context_that_is_not_a_whole_number(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bench import bench_real_cpu

    for bad in ("-1", "long"):
        with pytest.raises(SystemExit) as stop:
            bench_real_cpu.main(["--context", bad, "--variants", "int4"])
        assert stop.value.code == 2
        assert f"argument --context: expected a whole number >= 0, got '{bad}'" in (
            capsys.readouterr().err
        )
