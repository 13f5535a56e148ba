"""bench/bench_gemm_peak.py: the prefill's GEMM work counted from the
model's own weights, and the report's shares computed from its rows."""

from __future__ import annotations

from bench.bench_gemm_peak import SHAPES, prefill_flops, report
from graphrunner_ref import default_model


def test_prefill_work_is_the_layers_weights_per_token_and_the_head_once() -> None:
    model = default_model(max_requests=1).model
    layer_weights = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
    head = model.lm_head.weight.numel()
    assert prefill_flops(model, 7) == 2 * (7 * layer_weights + head)


def test_the_report_holds_each_mode_to_the_peak_of_its_gemm_dtype() -> None:
    gemms = [
        {"dtype": d, "shape": label, "gflops": g * (2 if label == "square" else 1)}
        for d, g in (("float32", 100.0), ("bfloat16", 400.0), ("int8", 800.0))
        for label, *_ in SHAPES
    ]
    prefills = [
        {"mode": "float32", "gemm_dtype": "float32", "tokens_per_s": 300.0, "gflops": 50.0},
        {"mode": "int4-q8", "gemm_dtype": "int8", "tokens_per_s": 600.0, "gflops": 400.0},
    ]
    text = report(gemms, prefills, {"device": "a CPU"})
    assert "- device: a CPU" in text
    assert "| float32 | 300 | 50.0 | float32 | 200.0 | 25% | 1.00x |" in text
    assert "| int4-q8 | 600 | 400.0 | int8 | 1600.0 | 25% | 2.00x |" in text
    assert "| square | 1024 x 1024 x 1024 | 200.0 | 800.0 | 1600.0 | 4.00x | 8.00x |" in text
