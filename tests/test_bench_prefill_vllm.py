"""``bench.bench_prefill_vllm``'s report: tokens/s from the seconds, each
mode against vLLM at its GEMM dtype, and its share of that dtype's peak."""

from __future__ import annotations

from bench.bench_prefill_vllm import PREFILL_BF16, report


def test_the_report_compares_each_mode_with_vllm_at_its_gemm_dtype() -> None:
    lengths = (256, 1024)
    mine = {"float32": [0.5, 4.0], PREFILL_BF16: [0.25, 1.0], "int4-q8": [0.2, 0.8]}
    theirs = {"bfloat16": [0.1, 0.5], "float32": [1.0, 2.0]}
    peak = {"float32": 100.0, "bfloat16": 1000.0, "int8": 2000.0}
    flops = {256: 10_000_000_000, 1024: 40_000_000_000}
    text = report(lengths, mine, theirs, peak, flops, {"device": "test"})
    assert "| 256 | 512 | 1024 | 1280 | 2560 | 256 |" in text  # tok/s: n / seconds
    # vLLM's float32 1.0 s / ours 0.5 s; its fastest (bfloat16) 0.1 s / 0.5 s
    assert "| 256 | float32 | 2.00x | 0.20x | 20.0 | 20% |" in text
    assert f"| 1,024 | {PREFILL_BF16} | 0.50x | 0.50x | 40.0 | 4% |" in text  # bfloat16 vLLM
    # No vLLM int8: against its fastest only (0.5 s / 0.8 s), the share of int8's peak
    assert "| 1,024 | int4-q8 | no vLLM | 0.62x | 50.0 | 2% |" in text
    alone = report(lengths, mine, {}, peak, flops, {})
    assert "| 256 | float32 | no vLLM | no vLLM |" in alone
