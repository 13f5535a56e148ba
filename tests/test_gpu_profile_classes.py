"""The GPU step profile's arithmetic, on the CPU: kernel names into classes,
device time per step, each class against its floor (the profile itself runs
on a GPU: ``bench/bench_gpu_profile.py``)."""

from __future__ import annotations

import pytest

from bench.bench_gpu_profile import CLASSES, class_rows, class_times, kernel_class

#: Kernel names as the profiler reports them on an H100, by the class each belongs to.
NAMES = {
    "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NNT": "projections",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "projections",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": "projections",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4>": "projections",
    "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>": (
        "projections"
    ),
    "_gemv_kernel": "projections",
    "_split_kernel": "attention",
    "_split_all_heads_kernel": "attention",
    "_merge_kernel": "attention",
    "triton_poi_fused_add_mul_0": "elementwise",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "elementwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>": (
        "elementwise"
    ),
    "Memcpy DtoD (Device -> Device)": "copies",
    "Memset (Device)": "copies",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collectives",
    "some_unknown_kernel": "other",
}


@pytest.mark.parametrize(("name", "cls"), NAMES.items())
def test_kernel_names_fall_in_their_class(name: str, cls: str) -> None:
    assert kernel_class(name) == cls


def test_times_per_step_and_each_class_against_its_floor() -> None:
    kernels = [
        ("_gemv_kernel", 800.0),
        ("nvjet_x", 200.0),
        ("_split_kernel", 150.0),
        ("_merge_kernel", 50.0),
        ("triton_poi_fused_0", 300.0),
    ]  # over 10 steps
    times = class_times(kernels, steps=10)
    assert set(times) == set(CLASSES)
    assert times["projections"] == 100.0 and times["attention"] == 20.0
    assert times["elementwise"] == 30.0 and times["other"] == 0.0
    rows = {r["class"]: r for r in class_rows(times, {"projections": 75.0, "attention": 5.0})}
    assert set(rows) == {"projections", "attention", "elementwise", "step"}  # no empty class
    assert rows["projections"]["pct_of_floor"] == pytest.approx(75.0)
    assert rows["attention"]["pct_of_floor"] == pytest.approx(25.0)
    assert rows["elementwise"]["floor_us"] is None and rows["elementwise"]["pct_of_floor"] is None
    assert rows["projections"]["share"] == pytest.approx(100 / 150)
    assert rows["step"]["us"] == 150.0
    assert rows["step"]["pct_of_floor"] == pytest.approx(100 * 80 / 150)
