"""The Triton small-batch linears (``kernels/gemv.py``) and the model path
through them (``use_small_batch_linears``).

The kernel must equal its torch reference (RMSNorm, linear, SwiGLU, the
modules' arithmetic) for every combination of norm and gate; a row's output
must not depend on any other row; a model whose small steps run the kernels
must serve transformers' greedy tokens through padded replay. Without a GPU
the kernel runs in Triton's interpreter (small shapes); it is also lowered to
Hopper code to check the weights stream as 128-bit loads.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_oracle import TRACE

from graphrunner_ref import default_model
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_model
from graphrunner_ref.model.kernels.gemv import MAX_ROWS, choose_blocks, gemv, reference
from graphrunner_ref.model.llama import use_small_batch_linears
from graphrunner_ref.model.quantize import quantize_model
from graphrunner_ref.model.small_batch import small_batch_linear
from hf_tiny import hf_greedy, save_tiny_llama
from hopper import compile_for_hopper

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: (norm, gated, residual): the kernel's variants (the model runs the first two,
#: the fourth and the fifth: norm + q/k/v, the LM head, norm + gate/up, o and down).
VARIANTS = [
    (False, False, False),
    (True, False, False),
    (False, True, False),
    (True, True, False),
    (False, False, True),
    (True, True, True),
]


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    return {"x": rand(m, k), "w": rand(n, k), "w2": rand(n, k), "g": rand(k) + 1, "r": rand(m, n)}


def _run(
    fn: object, ops: dict[str, torch.Tensor], norm: bool, gated: bool, residual: bool
) -> torch.Tensor:
    kwargs = {
        "weight2": ops["w2"] if gated else None,
        "norm_weight": ops["g"] if norm else None,
        "residual": ops["r"] if residual else None,
    }
    return fn(ops["x"], ops["w"], **kwargs)  # type: ignore[operator]


@pytest.mark.parametrize(("norm", "gated", "residual"), VARIANTS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 37, 50), (3, 96, 130), (MAX_ROWS, 20, 16)])
def test_kernel_equals_the_torch_modules(
    m: int, n: int, k: int, norm: bool, gated: bool, residual: bool
) -> None:
    ops = _operands(m, n, k, torch.float32)
    got, want = _run(gemv, ops, norm, gated, residual), _run(reference, ops, norm, gated, residual)
    # float32 sums in another order: the error grows with the products' size.
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize(("norm", "gated", "residual"), VARIANTS)
def test_bfloat16_within_a_rounding_of_the_reference(
    norm: bool, gated: bool, residual: bool
) -> None:
    ops = _operands(2, 24, 64, torch.bfloat16, seed=1)
    got, want = (
        _run(gemv, ops, norm, gated, residual).float(),
        _run(reference, ops, norm, gated, residual).float(),
    )
    assert got.dtype == want.dtype and got.shape == want.shape
    # A GPU rounds to nearest (2^-8 relative a rounding); Triton's interpreter
    # truncates float32 to bfloat16, and the norm's truncations all shrink the
    # products the same way. A gate near zero turns an ulp of its input into a
    # large relative error of a small output: the bound scales with the largest.
    rel = 2**-6 if DEVICE == "cuda" else 2**-5
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * want.abs().max().item())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize(("norm", "gated", "residual"), VARIANTS)
def test_another_row_never_reaches_a_live_row(norm: bool, gated: bool, residual: bool) -> None:
    clean = _operands(4, 40, 48, torch.float32, seed=2)
    poisoned = {**clean, "x": clean["x"].clone()}
    poisoned["x"][2] = float("nan")
    poisoned["x"][3, 5] = float("inf")
    got, want = (
        _run(gemv, poisoned, norm, gated, residual),
        _run(gemv, clean, norm, gated, residual),
    )
    assert torch.equal(got[:2], want[:2])
    assert got[2].isnan().all()


def test_blocks_fill_the_device_and_bound_the_tile() -> None:
    b = choose_blocks(1, 2560, 2048)  # the 1.1B shape's q/k/v at batch 1
    assert (b.block_m, b.block_n, b.block_k) == (1, 4, 2048)
    assert choose_blocks(1, 32000, 2048).block_n == 16  # enough programs already
    for m, n, k in [(1, 5632, 2048), (5, 2048, 5632), (MAX_ROWS, 7, 3)]:
        b = choose_blocks(m, n, k)
        assert b.block_m >= m and b.block_m * b.block_n * min(b.block_k, 8192) <= 8192 * 4
        assert b.block_k >= 16 and b.block_k & (b.block_k - 1) == 0
    with pytest.raises(ValueError, match=f"m={MAX_ROWS + 1}"):
        choose_blocks(MAX_ROWS + 1, 8, 8)


def test_bad_operands_are_refused_naming_their_shapes() -> None:
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"x \(2, 9\).*expected x \[M, K\]"):
        gemv(torch.randn(2, 9), w)
    with pytest.raises(ValueError, match=rf"1 <= M <= {MAX_ROWS}"):
        gemv(torch.randn(MAX_ROWS + 1, 8), w)
    with pytest.raises(ValueError, match="torch.float64"):
        gemv(x, w.double())
    with pytest.raises(ValueError, match=r"weight2 \(3, 8\)"):
        gemv(x, w, weight2=torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"residual \(2, 3\) torch.float32: expected \(2, 4\)"):
        gemv(x, w, residual=torch.randn(2, 3))


def test_the_op_matches_its_fake_and_the_kernel() -> None:
    ops = _operands(3, 16, 32, torch.float32, seed=3)
    args = (ops["x"], ops["w"], ops["w2"], ops["g"], None, 1e-5)
    torch.library.opcheck(small_batch_linear, args, test_utils=("test_schema", "test_faketensor"))
    expected = gemv(ops["x"], ops["w"], weight2=ops["w2"], norm_weight=ops["g"], eps=1e-5)
    assert torch.equal(small_batch_linear(*args), expected)
    args = (ops["x"], ops["w"], None, None, ops["r"], 1e-5)
    torch.library.opcheck(small_batch_linear, args, test_utils=("test_schema", "test_faketensor"))
    expected = gemv(ops["x"], ops["w"], residual=ops["r"])
    assert torch.equal(small_batch_linear(*args), expected)


def test_use_small_batch_linears_refuses_what_it_cannot_run() -> None:
    bundle = default_model(max_requests=2, max_context_len=16)
    for bad in (-1, MAX_ROWS + 1, 2.0, True):
        with pytest.raises(ValueError, match=rf"max_rows={bad!r}: expected an int in 0\.\.16"):
            use_small_batch_linears(bundle.model, bad)  # type: ignore[arg-type]
    quantize_model(bundle.model, "int8")
    with pytest.raises(ValueError, match="quantized \\('int8'\\)"):
        use_small_batch_linears(bundle.model, 4)


def test_decode_logits_equal_the_torch_path_at_every_small_size() -> None:
    bundle = default_model(max_requests=8, max_context_len=32)
    model, gen = bundle.model, torch.Generator().manual_seed(4)
    rows = 6
    r2t = bundle.req_pool.req_to_token
    r2t[1 : rows + 1, :5] = torch.arange(1, 5 * rows + 1).view(rows, 5)
    for layer in bundle.kv_cache.k_buffers + bundle.kv_cache.v_buffers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    batch = SimpleNamespace(
        input_ids=torch.randint(256, (rows,), generator=gen),
        positions=torch.full((rows,), 5),
        out_cache_loc=torch.arange(100, 100 + rows),
        req_pool_indices=torch.arange(1, rows + 1),
        seq_lens=torch.full((rows,), 6),
    )
    r2t[1 : rows + 1, 5] = batch.out_cache_loc.to(r2t.dtype)
    want = model.forward_decode(batch)
    use_small_batch_linears(model, 4)
    for n in (1, 4):
        part = SimpleNamespace(**{k: v[:n] for k, v in vars(batch).items()})
        torch.testing.assert_close(model.forward_decode(part), want[:n], rtol=1e-5, atol=1e-5)
    assert torch.equal(model.forward_decode(batch), want)  # 6 rows > 4: the torch path


def test_served_tokens_equal_transformers(tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path)
    # Three rows (padded to 4: the torch path), then two, then one (padded
    # to 2: the kernels with a padded row).
    trace = [Request(r.rid, r.prompt[:4], n) for r, n in zip(TRACE, (5, 2, 3), strict=False)]
    bundle = load_model(tmp_path, max_requests=4, max_context_len=32)
    use_small_batch_linears(bundle.model, 2)  # size 2 through the kernels, 4 not
    runner = create_decode_runner(bundle, "eager", capture_sizes=[2, 4], check_padding=True)
    runner.capture()
    result = Engine(bundle, runner).run(trace)
    expected = hf_greedy(hf, trace)
    assert result.outputs == {r.rid: expected[r.rid] for r in trace}
    assert result.stats.batch_sizes.keys() == {1, 2, 3} and result.stats.padded_rows >= 2


def test_compiled_program_writes_the_caches_in_place_and_equals_eager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's program (the CPU runner's, or CUDA graphs over it) calls the
    rotary + KV write op on the caches themselves and gives the eager tokens,
    every step checked against the eager forward."""
    if DEVICE == "cpu":  # Triton's interpreter inside a compile (a GPU compiles the kernels)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    trace = [Request(0, (5, 9, 2), 4), Request(1, (7,), 3)]  # one row padded to 2

    def tokens(kind: str, rows: int, **options: object) -> dict[int, list[int]]:
        bundle = default_model(max_requests=2, max_context_len=32, device=DEVICE)
        use_small_batch_linears(bundle.model, rows)
        runner = create_decode_runner(bundle, kind, capture_sizes=[2], **options)
        runner.capture()
        return Engine(bundle, runner, check=True).run(trace).outputs

    compiled = ("cuda", {"compile": True}) if DEVICE == "cuda" else ("cpu", {})
    assert tokens(compiled[0], 2, **compiled[1]) == tokens("eager", 0)


# Lowered for sm_90 with the launch's divisibility (16-byte aligned pointers
# and strides), as the JIT specializes real tensors: the weight tiles must
# load as 128-bit vectors, or the kernel cannot stream at the bandwidth.
_COMPILE_GEMV = """
    import re
    from triton.compiler import ASTSource
    import graphrunner_ref.model.kernels.gemv as g

    fn = triton.jit(g._gemv_kernel)
    types = ["*bf16"] * 6 + ["i32"] * 8 + ["fp32"]
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13)}
    for norm, gated, residual, pdl in ((False, False, True, False), (True, True, False, True)):
        b = g.choose_blocks(1, 2560, 2048)
        consts = dict(BLOCK_M=b.block_m, BLOCK_N=b.block_n, BLOCK_K=b.block_k,
                      HAS_NORM=norm, GATED=gated, HAS_RESIDUAL=residual, PDL=pdl)
        sig = dict(zip(fn.arg_names, types))
        sig.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=aligned)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        loads = re.findall(r"ld\\.global[.\\w]*", ptx)
        # Each weight tile, [BLOCK_N, BLOCK_K] bf16 over 128 threads, in 16-byte
        # loads; a scalar load at most per residual element of the program.
        vector = sum(".v4." in op for op in loads)
        assert vector >= b.block_n * b.block_k * 2 // (128 * 16) * (2 if gated else 1), loads
        assert len(loads) - vector <= (b.block_n if residual else 0), loads
        # The programmatic-launch wait and release exactly when PDL is set.
        assert programmatic(ptx) == pdl and ("griddepcontrol" in ptx) == pdl
    print("compiled")
"""


def test_kernel_compiles_for_hopper_with_vector_loads(tmp_path: Path) -> None:
    compile_for_hopper(_COMPILE_GEMV, tmp_path)


@pytest.mark.cuda
def test_one_point_one_b_shapes_on_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # Each product of the 1.1B shape with the variant the model runs it with.
    products = [
        ((1, 2560, 2048), (True, False, False)),  # norm + q/k/v
        ((4, 2048, 2048), (False, False, True)),  # o + residual
        ((1, 5632, 2048), (True, True, False)),  # norm + gate/up + SiLU
        ((16, 2048, 5632), (False, False, True)),  # down + residual
        ((8, 32000, 2048), (False, False, False)),  # the LM head
    ]
    for (m, n, k), variant in products:
        ops = _operands(m, n, k, torch.bfloat16, seed=m)
        got, want = _run(gemv, ops, *variant).float(), _run(reference, ops, *variant).float()
        bound = 2**-6 * want.abs() + 2**-6 * want.abs().max()
        assert ((got - want).abs() <= bound).all(), (m, n, k, variant)
