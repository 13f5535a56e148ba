"""4-bit group-wise weights (``--quantize int4``, :mod:`graphrunner_ref.model.int4_linear`).

The oracle is :func:`int4_reference_linear`: dequantize to float32, then
``F.linear``. Tests that run the C++ kernel take the ``kernel`` fixture: it
builds the kernel once into torch's extension cache (later runs load the
cached build) and skips with the reason where it cannot be built here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import graphrunner_ref
from graphrunner_ref.engine.workload import requests_from_prompts
from graphrunner_ref.model import default_model, int4_linear
from graphrunner_ref.model.fp16_linear import Fp16WeightLinear
from graphrunner_ref.model.int4_linear import (
    BLOCK_ROWS,
    GROUP,
    KERNEL_ENV,
    Int4Linear,
    block_codes,
    dequantize_int4,
    int4_kernel_status,
    int4_reference_linear,
    quantize_int4,
    unblock_codes,
)
from graphrunner_ref.model.int8_linear import Int8GroupLinear
from graphrunner_ref.model.quantize import (
    QUANTIZATIONS,
    check_quantization,
    exact_or_fp16_head,
    quantize_model,
)

#: (out, in, rows): in-features a multiple of 32, not one (padded), and below one group.
SHAPES = [(96, 64, 1), (1536, 576, 8), (40, 70, 5), (33, 7, 3), (17, 100, 9)]


@pytest.fixture(scope="module")
def kernel() -> None:
    why = int4_kernel_status()
    if why is not None:
        pytest.skip(f"int4 C++ kernel unavailable: {why}")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal within float rounding: 1e-4 of the output's scale."""
    scale = max(float(ref.abs().max()), 1.0)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize(("out", "inp", "rows"), SHAPES)
def test_round_trip_is_within_half_a_step_of_every_weight(out: int, inp: int, rows: int) -> None:
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(out)) * torch.rand(out, 1)
    w[0] = 0.25  # a constant row: scale 1, codes 0, exact
    packed, scales, mins = quantize_int4(w)
    groups = -(-inp // GROUP)
    assert packed.shape == (out, groups * 16) and packed.dtype == torch.uint8
    assert scales.shape == mins.shape == (out, groups) and scales.dtype == torch.float32
    back = dequantize_int4(packed, scales, mins, inp)
    assert back.shape == w.shape and torch.equal(back[0], w[0])
    step = scales.repeat_interleave(GROUP, dim=1)[:, :inp]
    assert bool(((back - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all())


def test_nibble_layout_is_q4_1s() -> None:
    """Byte j of a group: code j low, code j + 16 high; a group's min is code 0, max 15."""
    w = torch.arange(32, dtype=torch.float32)[None]
    packed, scales, mins = quantize_int4(w)
    assert float(mins[0, 0]) == 0.0 and float(scales[0, 0]) == pytest.approx(31 / 15)
    codes = torch.round(w / scales[0, 0]).to(torch.uint8)[0]
    assert torch.equal(packed[0], codes[:16] | (codes[16:] << 4))


def test_bad_weights_are_refused() -> None:
    for bad in (torch.randn(4), torch.tensor([[1.0, float("inf")]]), torch.ones(2, 2).long()):
        with pytest.raises(ValueError, match="quantize_int4"):
            quantize_int4(bad)


@pytest.mark.parametrize(("out", "inp", "rows"), SHAPES)
def test_kernel_equals_the_dequantized_reference(
    kernel: None, out: int, inp: int, rows: int
) -> None:
    gen = torch.Generator().manual_seed(inp)
    w, x = torch.randn(out, inp, generator=gen) * 0.05, torch.randn(2, rows, inp, generator=gen)
    linear = Int4Linear(w, kernel=True)
    y = linear(x)
    assert y.shape == (2, rows, out) and y.dtype == torch.float32
    _close(y, int4_reference_linear(x, linear.packed, linear.scales, linear.mins))
    _close(y, x @ linear.dequantized().T)
    torch_path = Int4Linear(w, kernel=False)
    _close(torch_path(x), y)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_other_rows_never_reach_a_live_row(use_kernel: bool) -> None:
    """Rows holding NaN, inf or huge values, or fewer rows in the batch, leave
    the live rows bit-equal."""
    if use_kernel and int4_kernel_status() is not None:
        pytest.skip(f"int4 C++ kernel unavailable: {int4_kernel_status()}")
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(80, 70, generator=gen), torch.randn(11, 70, generator=gen)
    linear = Int4Linear(w, kernel=use_kernel)
    poisoned = x.clone()
    poisoned[3], poisoned[4], poisoned[5:] = float("nan"), float("inf"), 3e38
    assert torch.equal(linear(poisoned)[:3], linear(x)[:3])
    if use_kernel:  # the kernel's per-row sums do not depend on the batch's size
        for j in range(11):
            assert torch.equal(linear(x[j : j + 1])[0], linear(x)[j])


def test_kernel_results_never_depend_on_neighbours(kernel: None) -> None:
    """The kernel runs rows in tiles of up to 8 and outputs in blocks of up to
    4 (a short last block repeats the last output): with an ``in`` that is not
    a multiple of 32 and an ``out`` that is not a multiple of any block, every
    row equals itself run alone and in every batch size, and every output equals
    itself computed as a one-output linear, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    out, inp = 37, 100
    w, x = torch.randn(out, inp, generator=gen), torch.randn(11, inp, generator=gen)
    linear = Int4Linear(w, kernel=True)
    together = linear(x)
    for rows in range(1, 12):
        assert torch.equal(linear(x[:rows]), together[:rows])
    for j in range(11):
        assert torch.equal(linear(x[j : j + 1])[0], together[j])
    for o in (0, 1, 35, 36):
        assert torch.equal(Int4Linear(w[o : o + 1], kernel=True)(x)[:, 0], together[:, o])
    _close(together, int4_reference_linear(x, linear.packed, linear.scales, linear.mins))


@pytest.mark.parametrize("out", [1, 4, 6, 37])
def test_blocked_codes_put_each_rows_group_at_its_place(out: int) -> None:
    """Row ``o``'s group ``g`` lies at bytes ``64 g + 16 (o % 4)`` of block
    ``o // 4``; rows past ``out`` are zero; unblocking gives ``packed`` back."""
    gen = torch.Generator().manual_seed(out)
    packed = torch.randint(0, 256, (out, 3 * 16), dtype=torch.uint8, generator=gen)
    blocked = block_codes(packed)
    blocks = -(-out // BLOCK_ROWS)
    assert blocked.shape == (blocks, 3 * 16 * BLOCK_ROWS) and blocked.is_contiguous()
    for o in range(blocks * BLOCK_ROWS):
        for g in range(3):
            at = blocked[o // BLOCK_ROWS, 64 * g + 16 * (o % BLOCK_ROWS) :][:16]
            want = (
                packed[o, 16 * g : 16 * g + 16] if o < out else torch.zeros(16, dtype=torch.uint8)
            )
            assert torch.equal(at, want), (o, g)
    assert torch.equal(unblock_codes(blocked, out), packed)


def test_kernel_refuses_codes_not_blocked(kernel: None) -> None:
    """Codes in :class:`Int4Weight`'s row order (``[out, groups * 16]``) are
    refused by name, with the shape the kernel expected."""
    linear = Int4Linear(torch.randn(8, 64), kernel=True)
    with pytest.raises(RuntimeError, match=r"blocked codes must be contiguous uint8 \[2, 128\]"):
        torch.ops.graphrunner_int4.linear(
            torch.randn(1, 64), linear.packed, linear.scales, linear.mins
        )


def test_kernel_rows_split_across_threads_equal_one_thread(kernel: None) -> None:
    """Several threads split the outputs wherever the split falls (inside a
    block of 4 here: 206 outputs in 3 chunks of 69): the same bits as one thread."""
    gen = torch.Generator().manual_seed(8)
    linear = Int4Linear(torch.randn(206, 100, generator=gen), kernel=True)
    x = torch.randn(9, 100, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = linear(x)
        torch.set_num_threads(3)
        split = linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, alone)


def test_kernel_runs_under_torch_compile(kernel: None) -> None:
    """Inductor calls the registered op (its fake gives the shape) in one graph."""
    gen = torch.Generator().manual_seed(3)
    linear = Int4Linear(torch.randn(48, 64, generator=gen), kernel=True)
    x = torch.randn(4, 64, generator=gen)
    compiled = torch.compile(linear, backend="inductor", fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), linear(x), rtol=0, atol=0)


def test_missing_compiler_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed build (here: load_inline raising) warns once; Int4Linear then
    runs the torch path, and kernel=True says why it cannot."""
    from torch.utils import cpp_extension

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler (test)")

    int4_kernel_status.cache_clear()
    try:
        monkeypatch.delenv(KERNEL_ENV, raising=False)
        monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
        with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler \(test\)\); int4 falls back"):
            why = int4_kernel_status()
        assert why is not None and "building the C++ kernels failed" in why
        w = torch.randn(8, 40)
        linear = Int4Linear(w)  # cached status: no second warning
        assert not linear.kernel
        with pytest.raises(RuntimeError, match="kernel=True"):
            Int4Linear(w, kernel=True)
        monkeypatch.setenv(KERNEL_ENV, "torch")
        int4_kernel_status.cache_clear()
        with pytest.warns(RuntimeWarning, match=f"{KERNEL_ENV}=torch"):
            assert int4_kernel_status() == f"{KERNEL_ENV}=torch"
    finally:
        monkeypatch.undo()
        int4_kernel_status.cache_clear()  # the next caller loads the cached build


def test_int4_is_a_quantize_mode_refused_off_float32() -> None:
    assert "int4" in QUANTIZATIONS and "group" in QUANTIZATIONS["int4"]
    check_quantization("int4", torch.float32, "cpu")
    with pytest.raises(
        ValueError, match=r"quantize='int4'.*torch.bfloat16.*expected torch.float32"
    ):
        check_quantization("int4", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"quantize='int4' runs on the CPU"):
        check_quantization("int4", torch.float32, "cuda")


@pytest.fixture
def quantized() -> Iterator[graphrunner_ref.ModelBundle]:
    bundle = default_model(max_requests=4)
    quantize_model(bundle.model, "int4")
    yield bundle


def _decode(bundle: graphrunner_ref.ModelBundle) -> dict[int, list[int]]:
    runner = graphrunner_ref.create_decode_runner(bundle, "eager", capture_sizes=[4])
    runner.capture()
    trace = requests_from_prompts([[1, 2, 3], [4, 5]], max_new_tokens=4)
    result = graphrunner_ref.Engine(bundle, runner).run(trace)
    assert bundle.kv_alloc.available_size() == bundle.kv_alloc.size
    return {rid: list(tokens) for rid, tokens in result.outputs.items()}


def _q8_0_weight(out: int, inp: int) -> torch.Tensor:
    """A float weight as a GGUF file's Q8_0 blocks dequantize: per group of 32,
    a float16 scale times int8 codes, one of them +-127."""
    gen = torch.Generator().manual_seed(3)
    groups = -(-inp // GROUP)
    codes = torch.randint(-127, 128, (out, groups, GROUP), generator=gen)
    codes[:, :, 5] = 127 * torch.where(torch.rand(out, groups, generator=gen) < 0.5, -1, 1)
    scales = (torch.rand(out, groups, 1, generator=gen) * 1e-2 + 1e-3).half().float()
    return (codes.float() * scales).view(out, -1)[:, :inp]


def test_int4_lm_head_is_int8_groups_only_where_they_hold_the_weight_exactly() -> None:
    """A Q8_0 head (SmolLM2's) is read as int8 groups, bit for bit, in half
    float16's bytes; any other float weight keeps float16, as before."""
    exact = _q8_0_weight(300, 70)
    head = exact_or_fp16_head(exact)
    assert isinstance(head, Int8GroupLinear) and torch.equal(head.dequantized(), exact)
    x = torch.randn(5, 70)
    ref = torch.nn.functional.linear(x.double(), exact.double()).float()
    torch.testing.assert_close(head(x), ref, rtol=1e-5, atol=1e-5)
    nearly = exact.clone()
    nearly[7, 3] += 1e-4  # one weight off the grid: int8 groups would round it
    assert isinstance(exact_or_fp16_head(nearly), Fp16WeightLinear)
    assert isinstance(exact_or_fp16_head(torch.randn(300, 70)), Fp16WeightLinear)


def test_int4_model_decodes_the_torch_paths_tokens(quantized: graphrunner_ref.ModelBundle) -> None:
    """Every projection is an Int4Linear and the (random, off the int8 grid)
    LM head float16 weights;
    eager decode gives 4 in-vocab tokens per request, the same whichever
    product runs."""
    model = quantized.model
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    layers = len(model.model.layers)
    assert len(linears) == 4 * layers and model.quantization == "int4"  # q/k/v, o, gate/up, down
    assert isinstance(model.head_proj, Fp16WeightLinear)
    outputs = _decode(quantized)
    vocab = model.config.vocab_size if hasattr(model, "config") else 256
    assert sorted(outputs) == [0, 1]
    for tokens in outputs.values():
        assert len(tokens) == 4 and all(0 <= t < vocab for t in tokens)
    if int4_linear.int4_kernel_status() is None:
        for m in linears:
            m.kernel = False
        assert _decode(quantized) == outputs
