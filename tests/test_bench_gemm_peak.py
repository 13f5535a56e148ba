"""bench/bench_gemm_peak.py: the prefill's GEMM work counted from the
model's own weights, and the report's shares and ratios computed from its rows."""

from __future__ import annotations

from bench.bench_gemm_peak import SHAPES, TILES_ONLY, cpu_slug, prefill_flops, report
from graphrunner_ref import default_model
from graphrunner_ref.model.cpu_features import CpuFeatures


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
    q8 = [
        {"shape": "gate/up", "m": 512, "k": 576, "n": 1536, "path": "amx-int8-tiles",
         "tiles_gops": 200.0, "path_gops": 320.0},
    ]  # fmt: skip
    prefills = [
        {"mode": "float32", "gemm_dtype": "float32", "kernel_path": "", "tokens_per_s": 300.0,
         "gflops": 50.0},
        {"mode": "int4-q8", "gemm_dtype": "int8", "kernel_path": "amx-int8-tiles",
         "tokens_per_s": 600.0, "gflops": 400.0},
        {"mode": TILES_ONLY, "gemm_dtype": "int8", "kernel_path": "avx512-vnni-tiles",
         "tokens_per_s": 480.0, "gflops": 320.0},
    ]  # fmt: skip
    text = report(gemms, q8, prefills, {"device": "a CPU"})
    assert "- device: a CPU" in text
    assert "| float32 | - | 300 | 50.0 | float32 | 200.0 | 25% | 1.00x |" in text
    assert "| int4-q8 | amx-int8-tiles | 600 | 400.0 | int8 | 1600.0 | 25% | 2.00x |" in text
    assert f"| {TILES_ONLY} | avx512-vnni-tiles | 480 | 320.0 | int8 | 1600.0 | 20% |" in text
    assert "| square | 1024 x 1024 x 1024 | 200.0 | 800.0 | 1600.0 | 4.00x | 8.00x |" in text
    # int4-q8's own product: its path against the tiles op, and its share of the int8 peak.
    assert "| gate/up | 512 x 576 x 1536 | 200.0 | 320.0 | 1.60x | 20% |" in text
    assert "AMX against AMX hidden: 1.25x" in text
    assert "int4-q8's product" not in report(gemms, [], prefills[:2], {})


def test_two_machines_of_one_name_write_apart() -> None:
    """One model name, AMX shown or hidden by the hypervisor: two results files."""

    def slug(*flags: str) -> str:
        return cpu_slug(
            CpuFeatures("Intel(R) Xeon(R) Processor", frozenset(flags), None, frozenset())
        )

    assert slug("avx2", "avx512f", "amx_tile") == "intel-r-xeon-r-processor-amx"
    assert slug("avx2", "avx512f") == "intel-r-xeon-r-processor-avx512"
    assert slug("avx2") == "intel-r-xeon-r-processor-avx2"
