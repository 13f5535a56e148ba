"""``bench.bench_prefill_vllm``'s report: tokens/s from the seconds, each
mode against vLLM at its GEMM dtype, and its share of that dtype's peak."""

from __future__ import annotations

from bench.bench_prefill_vllm import PREFILL_BF16, report


def test_the_report_compares_each_mode_with_vllm_at_its_gemm_dtype() -> None:
    lengths = (256, 1024)
    mine = {"float32": [0.5, 4.0], PREFILL_BF16: [0.25, 1.0]}
    theirs = {"bfloat16": [0.1, 0.5], "float32": [1.0, 2.0]}
    peak = {"float32": 100.0, "bfloat16": 1000.0}
    flops = {256: 10_000_000_000, 1024: 40_000_000_000}
    text = report(lengths, mine, theirs, peak, flops, {"device": "test"})
    assert "| 256 | 512 | 1024 | 2560 | 256 |" in text  # tok/s: n / seconds
    assert "| 256 | float32 | 2.00x | 20.0 | 20% |" in text  # vLLM 1.0 s / ours 0.5 s
    assert f"| 1,024 | {PREFILL_BF16} | 0.50x | 40.0 | 4% |" in text  # bfloat16 vLLM
    alone = report(lengths, mine, {}, peak, flops, {})
    assert "| 256 | float32 | no vLLM |" in alone
