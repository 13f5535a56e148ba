"""int4-q8's AMX path (``amx-int8-tiles``): a prompt chunk's rows as one AMX
GEMM over the AVX-512 VNNI tiles' layout, equal bit for bit to the tiles
path and to its torch emulation at every row count, each row independent of
the rows beside it; hidden by ``GRAPHRUNNER_CPU_DISABLE=amx_int8`` so that a
CPU without AMX (or CI) runs and tests the tiles path alone.

The AMX tests skip where the CPU, the OS or the build does not run the path;
the table and refusal tests run everywhere the kernels build.
"""

from __future__ import annotations

import pytest
import torch

from conftest import clear_kernel_choice
from graphrunner_ref.model import cpu_features as features_module
from graphrunner_ref.model.cpu_features import DISABLE_ENV, cpu_features, kernel_path
from graphrunner_ref.model.cpu_kernels import kernel_status
from graphrunner_ref.model.int4_q8 import (
    AMX_MIN_ROWS,
    AMX_PATH,
    TILES_PATH,
    Int4Q8Linear,
    int4_q8_tiles_reference_linear,
)

#: Rows of a call: decode's few, either side of the AMX threshold and of a
#: block of 16, and a whole 512-token prompt chunk.
ROWS = [1, 15, 16, 17, 64, 100, 512]
#: (out, in): outputs off a tile of 16, in off a group of 32 (7, 70, 100: a
#: last group padded; 100's 4 groups and 70's 3: an odd group left after the
#: pairs), and SmolLM2's MLP shapes.
SHAPES = [(40, 70), (33, 7), (17, 100), (1536, 576), (576, 1536)]


def _amx_runs() -> bool:
    """Whether int4-q8 takes the AMX path here (CPU, OS grant and build)."""
    path = kernel_path("int4-q8")
    return path is not None and path.code == AMX_PATH


def _tiled(x: torch.Tensor, linear: Int4Q8Linear) -> torch.Tensor:
    """``x`` through the AVX-512 VNNI tiles path's op over ``linear``'s tiles."""
    return torch.ops.graphrunner_int4.linear_q8_tiled(
        x, linear.tiles, linear.tile_scales, linear.tile_mins, linear.out_features
    )


def _weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=gen) * 0.05, gen


@pytest.mark.parametrize(("out", "inp"), SHAPES)
def test_the_amx_path_equals_the_tiles_path_at_every_row_count(out: int, inp: int) -> None:
    """At each row count of ROWS the AMX path's output is the tiles path's and
    the torch emulation of its float order, bit for bit."""
    if not _amx_runs():
        pytest.skip("the int4-q8 AMX path does not run on this CPU, OS or build")
    w, gen = _weights(out, inp, out + 7 * inp)
    linear = Int4Q8Linear(w, kernel=True)
    assert linear.tiled and linear.path_name == "amx-int8-tiles"
    x = torch.randn(max(ROWS), inp, generator=gen) * 3
    for rows in ROWS:
        y = linear(x[:rows])
        assert torch.equal(y, _tiled(x[:rows], linear)), rows
        if rows in (1, 17, 100) or (rows == 512 and out * inp < 400_000):
            ref = int4_q8_tiles_reference_linear(
                x[:rows], linear.packed, linear.scales, linear.mins
            )
            assert torch.equal(y, ref), rows


def test_a_chunk_row_never_depends_on_the_rows_beside_it() -> None:
    """A row's output is the same alone (the tiles path) and at any place of
    any chunk (AMX: blocks of 16, a last block short, two chunks of 512), and
    beside rows of NaN, inf and 3e38."""
    if not _amx_runs():
        pytest.skip("the int4-q8 AMX path does not run on this CPU, OS or build")
    w, gen = _weights(81, 100, 5)
    linear = Int4Q8Linear(w, kernel=True)
    x = torch.randn(530, 100, generator=gen)
    together = linear(x)
    for j in (0, 15, 16, 17, 100, 511, 512, 529):
        assert torch.equal(linear(x[j : j + 1])[0], together[j]), j
    for rows in (AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 31, 33, 64, 513):
        assert torch.equal(linear(x[:rows]), together[:rows]), rows
    assert torch.equal(linear(x[7:107]), together[7:107])  # rows at other places of their block
    poisoned = x[:100].clone()
    poisoned[40], poisoned[41], poisoned[42:] = float("nan"), float("inf"), 3e38
    assert torch.equal(linear(poisoned)[:40], together[:40])


def test_the_amx_path_runs_under_torch_compile() -> None:
    """Inductor calls the AMX op as one extern kernel (its fake gives the
    shape): the compiled chunk's output is the eager one's."""
    if not _amx_runs():
        pytest.skip("the int4-q8 AMX path does not run on this CPU, OS or build")
    w, gen = _weights(48, 64, 3)
    linear = Int4Q8Linear(w, kernel=True)
    x = torch.randn(32, 64, generator=gen)
    compiled = torch.compile(linear, backend="inductor", fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), linear(x))


def test_hiding_amx_runs_the_tiles_path(fresh_features: pytest.MonkeyPatch) -> None:
    """``GRAPHRUNNER_CPU_DISABLE=amx_int8`` hides AMX: int4-q8 takes the tiles
    path where the CPU has AVX-512 VNNI, and gives the AMX path's output."""
    if kernel_status() is not None:
        pytest.skip(f"C++ kernels unavailable: {kernel_status()}")
    w, gen = _weights(48, 96, 9)
    x = torch.randn(40, 96, generator=gen)
    amx = _amx_runs()
    fast = Int4Q8Linear(w)(x)
    fresh_features.setenv(DISABLE_ENV, "amx_int8")
    clear_kernel_choice()
    assert not cpu_features().has("amx_int8")
    path = kernel_path("int4-q8")
    assert path is not None and path.code != AMX_PATH
    hidden = Int4Q8Linear(w)
    assert hidden.path != AMX_PATH
    if amx:  # the same tiles, the same float order: the same output
        assert path.code == TILES_PATH and torch.equal(hidden(x), fast)


def test_the_table_picks_amx_only_with_its_features(fresh_features: pytest.MonkeyPatch) -> None:
    """A CPU with AMX-INT8 (granted) and AVX-512 VNNI gets the AMX path where
    the build compiled it; without amx_int8 or amx_tile, the tiles path."""
    if kernel_status() is not None:
        pytest.skip(f"C++ kernels unavailable: {kernel_status()}")
    compiled = int(torch.ops.graphrunner_int4.q8_paths())
    if not compiled >> AMX_PATH & 1:
        pytest.skip("this build has no AMX path (an older compiler)")
    vnni = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}

    def pretend(flags: set[str]) -> str | None:
        fresh_features.setattr(features_module, "_cpuinfo", lambda: ("Test Xeon", flags))
        fresh_features.setattr(features_module, "amx_permitted", lambda: True)
        clear_kernel_choice()
        path = kernel_path("int4-q8")
        return None if path is None else path.name

    assert pretend(vnni | {"amx_tile", "amx_int8"}) == "amx-int8-tiles"
    assert pretend(vnni | {"amx_tile"}) == "avx512-vnni-tiles"
    assert pretend(vnni | {"amx_int8"}) == "avx512-vnni-tiles"
    assert pretend({"avx2", "fma", "f16c", "amx_tile", "amx_int8"}) != "amx-int8-tiles"


def test_the_amx_op_is_refused_where_it_cannot_run(fresh_features: pytest.MonkeyPatch) -> None:
    """Called where the CPU or OS gives no AMX, the op raises rather than
    running an illegal instruction (features read with none hidden: hiding
    AMX steers the choice, not the hardware)."""
    if kernel_status() is not None:
        pytest.skip(f"C++ kernels unavailable: {kernel_status()}")
    if _amx_runs() or cpu_features().amx_permitted:
        pytest.skip("this CPU runs AMX")
    x = torch.randn(32, 64)
    tiles = torch.zeros(1, 2 * 256, dtype=torch.uint8)
    halves = torch.zeros(1, 2, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="linear_q8_amx: needs a build with AMX-INT8"):
        torch.ops.graphrunner_int4.linear_q8_amx(x, tiles, halves, halves, 16)
