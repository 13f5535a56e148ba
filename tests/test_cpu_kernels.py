"""The C++ kernels of float32 models' ``--quantize int8`` and ``fp16``
(``graphrunner_int8::linear``, ``graphrunner_fp16::linear``): equal to the
dequantized weight's product, a row's result independent of the rows beside
it and of how many rows run (bit for bit), callable from compiled code;
int8 with half-precision activations keeps torch's weight-only product.
(int4's kernel: ``tests/test_int4.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphrunner_ref.model.cpu_kernels import kernel_status
from graphrunner_ref.model.fp16_linear import Fp16WeightLinear, pack_fp16, unpack_fp16
from graphrunner_ref.model.int8_linear import Int8GroupLinear, Int8Linear, quantize_per_group


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    why = kernel_status()
    if why is not None:
        pytest.skip(f"C++ kernels unavailable here: {why}")


@pytest.mark.parametrize(("out", "inp", "rows"), [(24, 64, 1), (40, 45, 8), (7, 100, 11)])
def test_kernel_equals_the_dequantized_product(out: int, inp: int, rows: int) -> None:
    torch.manual_seed(out + inp)
    linear = Int8Linear(torch.randn(out, inp), torch.float32)
    assert linear.kernel
    x = torch.randn(rows, inp)
    expected = F.linear(x, linear.dequantized())
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    # torch's own weight-only product on the same codes agrees too.
    torch.testing.assert_close(
        linear(x), torch._weight_int8pack_mm(x, linear.weight, linear.scales), rtol=1e-5, atol=1e-5
    )


def test_a_row_never_depends_on_the_rows_beside_it() -> None:
    torch.manual_seed(1)
    linear = Int8Linear(torch.randn(33, 70), torch.float32)
    x = torch.randn(11, 70)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(11)])
    together = linear(x)
    assert torch.equal(alone, together)
    poisoned = x.clone()
    poisoned[3:] = 1e30  # other rows, huge: a live row reads only its own
    assert torch.equal(linear(poisoned)[:3], together[:3])


def test_the_kernel_runs_under_torch_compile() -> None:
    torch.manual_seed(2)
    linear = Int8Linear(torch.randn(16, 48), torch.float32)
    x = torch.randn(4, 48)
    compiled = torch.compile(linear, fullgraph=True)
    torch.testing.assert_close(compiled(x), linear(x), rtol=0, atol=0)


def test_half_precision_activations_keep_torchs_product() -> None:
    linear = Int8Linear(torch.randn(16, 48), torch.bfloat16)
    assert not linear.kernel
    x = torch.randn(2, 48, dtype=torch.bfloat16)
    assert linear(x).dtype == torch.bfloat16
    assert "torch._weight_int8pack_mm" in repr(linear)


@pytest.mark.parametrize(("out", "inp"), [(8, 8), (13, 45), (192, 576), (5, 3)])
def test_fp16_packing_round_trips(out: int, inp: int) -> None:
    w = torch.randn(out, inp)
    packed = pack_fp16(w)
    in8 = -(-inp // 8) * 8
    assert packed.dtype == torch.float16 and packed.shape == (-(-out // 8), 8 * in8)
    assert torch.equal(unpack_fp16(packed, out, inp), w.half())


@pytest.mark.parametrize(("out", "inp"), [(24, 64), (13, 45), (40, 100), (3, 7)])
def test_fp16_kernel_equals_the_float16_weights_product(out: int, inp: int) -> None:
    torch.manual_seed(out * inp)
    w = torch.randn(out, inp)
    linear = Fp16WeightLinear(w)
    assert linear.kernel and torch.equal(linear.dequantized(), w.half().float())
    for rows in (1, 2, 3, 4, 7, 11):
        x = torch.randn(rows, inp)
        torch.testing.assert_close(linear(x), x @ w.half().float().T, rtol=1e-5, atol=1e-5)


def test_fp16_rows_are_bit_for_bit_independent_of_the_batch() -> None:
    torch.manual_seed(3)
    linear = Fp16WeightLinear(torch.randn(37, 70))
    x = torch.randn(11, 70)
    together = linear(x)
    for rows in (1, 2, 3, 5, 8):  # every tile size and remainder
        assert torch.equal(linear(x[:rows]), together[:rows]), rows
    poisoned = x.clone()
    poisoned[4:] = float("nan")
    assert torch.equal(linear(poisoned)[:4], together[:4])


def test_fp16_kernel_runs_under_torch_compile() -> None:
    linear = Fp16WeightLinear(torch.randn(20, 36))
    x = torch.randn(3, 36)
    compiled = torch.compile(linear, fullgraph=True)
    torch.testing.assert_close(compiled(x), linear(x), rtol=0, atol=0)


@pytest.mark.parametrize(("out", "inp"), [(24, 64), (13, 45), (40, 100), (3, 7)])
def test_grouped_int8_kernel_equals_the_dequantized_product(out: int, inp: int) -> None:
    torch.manual_seed(out + 7 * inp)
    linear = Int8GroupLinear(torch.randn(out, inp))
    assert linear.kernel and linear.weight.shape == (out, -(-inp // 32) * 32)
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, inp)
        torch.testing.assert_close(linear(x), x @ linear.dequantized().T, rtol=1e-5, atol=1e-5)


def test_grouped_int8_keeps_a_q8_0_weight_bit_for_bit() -> None:
    """GGUF's Q8_0 (``d`` a float16 per 32 columns, ``q`` in -127..127 with
    127 reached in every block) dequantized and quantized again is the same."""
    torch.manual_seed(5)
    d = (torch.rand(16, 3) * 0.01 + 1e-3).half().float()
    q = torch.randint(-127, 128, (16, 3, 32))
    q[..., 0] = 127 * torch.sign(torch.randn(16, 3)).long()
    w = (q.float() * d[..., None]).view(16, 96)
    codes, scales = quantize_per_group(w)
    assert torch.equal(codes.view(16, 3, 32).long(), q) and torch.equal(scales, d)
    assert torch.equal(Int8GroupLinear(w).dequantized(), w)


def test_grouped_int8_rows_are_bit_for_bit_independent_of_the_batch() -> None:
    torch.manual_seed(6)
    linear = Int8GroupLinear(torch.randn(37, 70))
    x = torch.randn(19, 70)
    together = linear(x)
    for j in range(19):
        assert torch.equal(linear(x[j : j + 1])[0], together[j]), j
    poisoned = x.clone()
    poisoned[4:] = float("nan")
    assert torch.equal(linear(poisoned)[:4], together[:4])
    compiled = torch.compile(linear, fullgraph=True)
    torch.testing.assert_close(compiled(x), together, rtol=0, atol=0)
    linear.kernel = False  # the torch path: the same product, another order
    torch.testing.assert_close(linear(x), together, rtol=1e-5, atol=1e-5)


def test_the_streaming_kernels_keep_their_prefetches() -> None:
    """The int4, int4-q8 and int8-group kernels at 1 row request the weights
    ahead of their use (``BlockPrefetch`` and ``rows_int8g`` in
    ``cpu_kernels.cpp``): a build whose compiler dropped the requests (GCC
    once dropped every call to a non-inlined helper that only prefetches)
    streams its weights 1.2-1.4x slower, with no wrong output to show it.
    Read from the built library's disassembly."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    from torch.utils import cpp_extension

    from graphrunner_ref.model.cpu_kernels import KERNEL_BUILD

    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump is not installed")
    library = Path(cpp_extension._get_build_directory(KERNEL_BUILD, False)) / f"{KERNEL_BUILD}.so"
    if not library.exists():
        pytest.skip(f"{library} is not where torch builds it here")
    listing = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    kernels = ("rows_avx2<1>", "rows_q8_avx2<1>", "rows_int8g<1>")
    prefetches = {}
    for body in listing.split("\n\n"):
        found = re.search(r"<[^>]*?(rows_\w+<1>)\(", body.split("\n", 1)[0])
        if found and found.group(1) in kernels:
            prefetches[found.group(1)] = body.count("prefetch")
    assert set(prefetches) == set(kernels), f"kernels found: {sorted(prefetches)}"
    assert all(n > 0 for n in prefetches.values()), prefetches
