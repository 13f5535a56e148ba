"""``bench/bench_kv_dtype.py``'s long prompts (each chat prompt repeated whole,
then cut, to the context) and its refusal of a variant without a float16 twin."""

from __future__ import annotations

import pytest

from bench import bench_kv_dtype


def test_each_prompt_is_repeated_then_cut_to_the_context() -> None:
    got = bench_kv_dtype.long_prompts([[1, 2, 3], [4]], 7)
    assert got == [[1, 2, 3, 1, 2, 3, 1], [4] * 7]
    assert bench_kv_dtype.long_prompts([[5, 6]], 2) == [[5, 6]]


def test_a_variant_without_a_float16_twin_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        bench_kv_dtype.main(["--variant", "int4"])
    assert stop.value.code == 2
    assert "argument --variant: invalid choice: 'int4'" in capsys.readouterr().err
