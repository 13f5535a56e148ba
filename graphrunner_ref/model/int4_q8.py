"""4-bit weights times 8-bit activations (``--quantize int4-q8``), opt-in.

The weights are :mod:`~graphrunner_ref.model.int4_linear`'s (groups of 32
input columns, a float32 scale and min each). Each input row is cut into
the same groups of 32 and quantized on its own, as llama.cpp's Q8 blocks
are: ``d = max|x_g| / 127`` and ``qx = round_half_even(x_g * (127 / max|x_g|))``
in -127..127 (a group of zeros: ``d = 0``, codes 0). The product is then an
integer dot per group, exact in int32, and a float sum over groups:

    y[r, o] = sum_g (scale[o, g] * d[r, g]) * (q[o, g] . qx[r, g])
              + min[o, g] * d[r, g] * sum(qx[r, g])

that is, the dequantized row ``d * qx`` times the weight, as llama.cpp's
Q4_1 x Q8_1 product. The min's share takes the quantized row's sum, not the
floats': then each activation's rounding error meets its own weight (of
either sign, so the errors cancel as the weights do), where the floats' sum
would leave it times ``weight - min`` (all of one sign). On SmolLM2,
teacher-forced over the 8 chat prompts (``bench/bench_agreement.py``), that
took the logits' RMS error against float32 transformers' from 0.58 to 0.27
(llama.cpp's Q4_1 x Q8_1: 0.24) and the greedy picks equal to theirs from
93% to 98% (llama.cpp 97%). The C++ kernel
(``graphrunner_int4::linear_q8``) runs the integer dot with the instruction
its path names (AVX2 ``vpmaddubsw`` + ``vpmaddwd``, AVX-VNNI or AVX-512 VNNI
``vpdpbusd``, AMX-INT8 ``tdpbsud`` for prompt chunks:
:data:`~graphrunner_ref.model.cpu_features.KERNEL_PATHS`); every path gives
the same int32, so the same output bit for bit (the two tiles paths sum
floats in their own order: :func:`int4_q8_tiles_reference_linear`). A row's groups
are quantized from that row alone and summed in a fixed order, so a row's
output never depends on the rows beside it or their number.

The mode runs this product for each layer's output, gate/up and down
projections; the q/k/v projection keeps int4's float32 activations
(:func:`~graphrunner_ref.model.quantize.qkv_linear` says why).

:func:`int4_q8_reference_linear` is the torch oracle (and the fallback where
the kernels cannot run): the same quantization, equal bit for bit, and the
same integer dots; only its float sum's order differs.
"""

from __future__ import annotations

import torch

from graphrunner_ref.model.cpu_features import kernel_path
from graphrunner_ref.model.int4_linear import (
    GROUP,
    Int4Linear,
    Int4Weight,
    block_codes,
    unblock_codes,
)
from graphrunner_ref.model.int8_linear import Int8GroupLinear

__all__ = [
    "AMX_PATH",
    "TILES_PATH",
    "TILES_PATHS",
    "TILE_ROWS",
    "AMX_MIN_ROWS",
    "Int4Q8Linear",
    "Int8GroupQ8Linear",
    "int8_q8_tiles_reference_linear",
    "tile_int8",
    "untile_int8",
    "int4_q8_reference_linear",
    "int4_q8_tiles_reference_linear",
    "half_scales",
    "quantize_activations_q8",
    "tile_codes",
    "untile_codes",
]

#: The path number of the AVX-512 VNNI tiles path (its own op and layout).
TILES_PATH = 3
#: The path number of the AMX-INT8 path: the tiles path's layout and output
#: bit for bit, prompt chunks of :data:`AMX_MIN_ROWS` rows or more on AMX tiles
#: (``graphrunner_int4::linear_q8_amx``).
AMX_PATH = 4
#: The paths over :func:`tile_codes`' layout.
TILES_PATHS = frozenset({TILES_PATH, AMX_PATH})
#: Rows from which the AMX path runs a call on AMX (fewer: the tiles path's
#: loop, as decode always ran; ``kAmxMinRows`` in ``cpu_kernels.cpp``).
AMX_MIN_ROWS = 16


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` float32 ``[rows, in]`` per group of 32 columns (the last padded
    with zeros): int8 codes ``[rows, groups, 32]``, float32 scales ``d`` and
    float32 sums of the dequantized groups ``d * sum(qx)`` ``[rows, groups]``,
    the kernel's quantization exactly."""
    rows, inp = x.shape
    groups = -(-inp // GROUP)
    padded = torch.zeros(rows, groups * GROUP, dtype=torch.float32)
    padded[:, :inp] = x
    g = padded.view(rows, groups, GROUP)
    amax = g.abs().amax(dim=2)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).clamp_(-128, 127).to(torch.int8)
    d = amax / 127.0
    return q, d, d * q.sum(dim=2, dtype=torch.int32).float()


def int4_q8_reference_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[..., in]`` float32 through the int4 x q8 product: ``[..., out]``
    float32 (``packed`` ``[out, groups * 16]``, ``scales``/``mins`` ``[out, groups]``)."""
    lead, inp = x.shape[:-1], x.shape[-1]
    out, groups = scales.shape
    qx, d, sums = quantize_activations_q8(x.reshape(-1, inp).float())
    b = packed.view(out, groups, 16)
    codes = torch.cat([b & 0x0F, b >> 4], dim=2).to(torch.int32)  # [out, groups, 32]
    # Integer dots per (row, output, group): exact in int32 (|dot| <= 32 * 15 * 128).
    dots = torch.einsum("rgk,ogk->rog", qx.to(torch.int32), codes)
    y = (dots.double() * (scales[None] * d[:, None, :]).double()).sum(dim=2)
    y = y + (mins[None].double() * sums[:, None, :].double()).sum(dim=2)
    return y.float().view(*lead, out)


#: Output rows a tile of the AVX-512 VNNI tiles path (one a 32-bit lane).
TILE_ROWS = 16


def tile_codes(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiles path's layout of ``packed`` uint8 ``[out, groups * 16]``,
    ``scales`` and ``mins`` float32 ``[out, groups]``: output rows in tiles of
    16 (zero codes, scales and mins past ``out``); ``tiles`` uint8
    ``[tiles, groups * 256]``, each group 8 quads of 32 bytes, quad ``j``'s byte
    ``t`` holding the codes of column ``4j + t % 4`` for output ``t // 4``
    (low nibble) and output ``8 + t // 4`` (high nibble); ``tile_scales`` and
    ``tile_mins`` float16 ``[tiles, groups, 16]`` (the scales and mins
    rounded to float16, as a Q4_1 file holds them: :func:`half_scales`)."""
    out, groups = scales.shape
    count = -(-out // TILE_ROWS)
    rows = count * TILE_ROWS
    b = torch.zeros(rows, groups, 16, dtype=torch.uint8)
    b[:out] = packed.view(out, groups, 16)
    codes = torch.cat([b & 0x0F, b >> 4], dim=2)  # [rows, groups, 32]: column order
    # [tile, half, lane, group, quad, column of the quad] -> [tile, group, quad, lane, column, half]
    c = codes.view(count, 2, 8, groups, 8, 4).permute(0, 3, 4, 2, 5, 1)
    tiles = (c[..., 0] | (c[..., 1] << 4)).reshape(count, groups * 256).contiguous()

    def spread(v: torch.Tensor) -> torch.Tensor:
        padded = v.new_zeros(rows, groups, dtype=torch.float16)
        padded[:out] = v
        return padded.view(count, TILE_ROWS, groups).transpose(1, 2).contiguous()

    return tiles, spread(scales), spread(mins)


def half_scales(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scales`` and ``mins`` rounded to float16 and back to float32: the
    tiles path's weights (a Q4_1 file's are float16 already, and come back
    unchanged)."""
    return scales.half().float(), mins.half().float()


def untile_codes(tiles: torch.Tensor, out: int) -> torch.Tensor:
    """The ``[out, groups * 16]`` codes of :func:`tile_codes`' ``tiles``."""
    count, width = tiles.shape
    groups = width // 256
    t = tiles.view(count, groups, 8, 8, 4)  # [tile, group, quad, lane, column]
    halves = torch.stack([t & 0x0F, t >> 4], dim=-1)  # [..., half]
    codes = halves.permute(0, 5, 3, 1, 2, 4).reshape(count * TILE_ROWS, groups, 32)[:out]
    return (codes[..., :16] | (codes[..., 16:] << 4)).reshape(out, groups * 16)


def int4_q8_tiles_reference_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[..., in]`` float32 through the tiles path's arithmetic: the same
    quantized rows and integer dots as :func:`int4_q8_reference_linear`, then
    per (row, output) the groups in order, ``acc = fma(dot, scale * d, acc)``
    and ``acc = fma(min, d * sum(qx), acc)`` in float32 (each FMA emulated in
    float64, then rounded once: exact, as float64 holds each product whole and
    a sum's float64 rounding would have to fall on a float32 tie to differ)."""
    lead, inp = x.shape[:-1], x.shape[-1]
    out, groups = scales.shape
    qx, d, sums = quantize_activations_q8(x.reshape(-1, inp).float())
    b = packed.view(out, groups, 16)
    codes = torch.cat([b & 0x0F, b >> 4], dim=2).to(torch.int32)
    dots = torch.einsum("rgk,ogk->rog", qx.to(torch.int32), codes)
    return _tiles_sum(dots, scales, d, (mins, sums)).view(*lead, out)


def _tiles_sum(
    dots: torch.Tensor,
    scales: torch.Tensor,
    d: torch.Tensor,
    min_share: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The tiles kernels' float sums of integer ``dots`` ``[rows, out, groups]``:
    per (row, output), the groups in order, ``acc = fma(dot, scale * d, acc)``
    (``scales`` ``[out, groups]``, ``d`` ``[rows, groups]``) and, with
    ``min_share = (mins, sums)``, ``acc = fma(min, sum, acc)``; each FMA
    emulated in float64 and rounded once. ``[rows, out]`` float32."""
    acc = torch.zeros(dots.shape[0], dots.shape[1], dtype=torch.float32)
    for g in range(dots.shape[2]):
        s = (scales[None, :, g] * d[:, None, g]).double()  # float32 product, then widened
        acc = (dots[:, :, g].double() * s + acc.double()).float()
        if min_share is not None:
            mins, sums = min_share
            acc = (mins[None, :, g].double() * sums[:, None, g].double() + acc.double()).float()
    return acc


def tile_int8(weight: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles path's layout of int8 grouped codes ``weight`` ``[out, groups * 32]``
    and ``scales`` ``[out, groups]`` (``Int8GroupLinear``'s): ``tiles`` uint8
    ``[tiles, groups * 512]``, group g's quad j 64 bytes, byte ``4 * lane + c``
    the code of column ``4j + c`` for output ``lane`` plus 128 (the kernel's
    unsigned operand); ``tile_scales`` float32 ``[tiles, groups, 16]``. Zeros
    (128) past ``out``."""
    out, groups = scales.shape
    count = -(-out // TILE_ROWS)
    rows = count * TILE_ROWS
    codes = torch.zeros(rows, groups, GROUP, dtype=torch.int16)
    codes[:out] = weight.view(out, groups, GROUP)
    # [tile, lane, group, quad, column] -> [tile, group, quad, lane, column]
    tiles = (
        (codes + 128).to(torch.uint8).view(count, TILE_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)
    )
    padded = scales.new_zeros(rows, groups)
    padded[:out] = scales
    return (
        tiles.reshape(count, groups * 512).contiguous(),
        padded.view(count, TILE_ROWS, groups).transpose(1, 2).contiguous().float(),
    )


def untile_int8(tiles: torch.Tensor, out: int) -> torch.Tensor:
    """The int8 codes ``[out, groups * 32]`` of :func:`tile_int8`'s ``tiles``."""
    count, width = tiles.shape
    groups = width // 512
    t = tiles.view(count, groups, 8, TILE_ROWS, 4).permute(0, 3, 1, 2, 4)
    codes = t.reshape(count * TILE_ROWS, groups * GROUP)[:out]
    return (codes.to(torch.int16) - 128).to(torch.int8)


def int8_q8_tiles_reference_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """``x`` ``[..., in]`` float32 through the tiled int8-group head's
    arithmetic: the rows quantized as :func:`quantize_activations_q8`, exact
    integer dots per group, then per (row, output) ``acc = fma(dot, scale *
    d, acc)`` over the groups in order, each FMA emulated in float64 and
    rounded once (``weight`` int8 ``[out, groups * 32]``, ``scales`` ``[out, groups]``)."""
    lead, inp = x.shape[:-1], x.shape[-1]
    out, groups = scales.shape
    qx, d, _ = quantize_activations_q8(x.reshape(-1, inp).float())
    codes = weight.view(out, groups, GROUP).to(torch.int32)
    dots = torch.einsum("rgk,ogk->rog", qx.to(torch.int32), codes)
    return _tiles_sum(dots, scales, d).view(*lead, out)


class Int8GroupQ8Linear(Int8GroupLinear):
    """int4-q8's LM head where the tiles path runs (AVX-512 VNNI):
    :class:`~graphrunner_ref.model.int8_linear.Int8GroupLinear`'s int8 codes
    in groups of 32 (a GGUF file's Q8_0 head exactly), held as
    :func:`tile_int8`'s tiles (``weight`` emptied: one copy of the codes,
    :meth:`codes` gives them back), times the row quantized to 8 bits as the
    projections' rows are (``graphrunner_int8::linear_grouped_q8_tiled``):
    ``[..., in]`` float32 ``-> [..., out]`` float32; rows independent of the
    batch bit for bit. ``kernel=False`` runs
    :func:`int8_q8_tiles_reference_linear`, equal bit for bit."""

    tiles: torch.Tensor
    tile_scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, kernel: bool = True) -> None:
        super().__init__(weight)
        path = kernel_path("int4-q8") if kernel else None
        if kernel and (path is None or path.code not in TILES_PATHS):
            raise RuntimeError(
                "Int8GroupQ8Linear: the int4-q8 tiles path (AVX-512 VNNI) does not run here"
            )
        self.kernel = kernel
        tiles, tile_scales = tile_int8(self.weight, self.scales)
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)
        self.weight = self.weight.new_empty(0, self.weight.shape[1])

    def codes(self) -> torch.Tensor:
        """The int8 codes ``[out, groups * 32]``, from the tiles."""
        return untile_int8(self.tiles, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            return int8_q8_tiles_reference_linear(x, self.codes(), self.scales)
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.graphrunner_int8.linear_grouped_q8_tiled(
            flat, self.tiles, self.tile_scales, self.out_features
        )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = "C++ avx512-vnni-tiles kernel" if self.kernel else "torch reference"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 groups of {GROUP} x int8 activations per group ({path})"
        )


class Int4Q8Linear(Int4Linear):
    """:class:`~graphrunner_ref.model.int4_linear.Int4Linear`'s weights, its
    activations quantized to 8 bits per group of 32: ``[..., in]`` float32
    ``-> [..., out]`` float32. ``kernel``: None (the C++ kernel on
    :func:`~graphrunner_ref.model.cpu_features.kernel_path`'s path where the
    kernels build, else :func:`int4_q8_reference_linear`), True (the kernel;
    RuntimeError where it cannot run) or False (the torch path). On the
    ``avx512-vnni-tiles`` and ``amx-int8-tiles`` paths the codes are held as
    :func:`tile_codes`' tiles (``tiles``, ``tile_scales``, ``tile_mins``)
    instead of ``blocked``, and the scales and mins are rounded to float16
    (:func:`half_scales`); the AMX path runs calls of :data:`AMX_MIN_ROWS` rows
    or more (a prompt chunk) as one AMX GEMM, bit for bit the tiles path's."""

    tiles: torch.Tensor
    tile_scales: torch.Tensor
    tile_mins: torch.Tensor

    def __init__(self, weight: torch.Tensor, kernel: bool | None = None) -> None:
        super().__init__(weight, kernel)
        path = kernel_path("int4-q8") if self.kernel else None
        if self.kernel and path is None:
            raise RuntimeError("Int4Q8Linear: no int4-q8 kernel path for this CPU's features")
        # A plain int read at trace time: the compiled program calls one path.
        self.path = -1 if path is None else path.code
        self.path_name = "torch" if path is None else path.name
        self.tiled = self.path in TILES_PATHS
        if self.tiled:
            self._tile(unblock_codes(self.blocked, self.out_features))

    def _tile(self, packed: torch.Tensor) -> None:
        """Hold ``packed`` as tiles (``blocked`` emptied: one copy of the codes),
        the scales and mins rounded to float16 (:func:`half_scales`), here too."""
        scales, mins = half_scales(self.scales, self.mins)
        self.scales.copy_(scales)
        self.mins.copy_(mins)
        tiles, tile_scales, tile_mins = tile_codes(packed, self.scales, self.mins)
        self.register_buffer("tiles", tiles)
        self.register_buffer("tile_scales", tile_scales)
        self.register_buffer("tile_mins", tile_mins)
        self.blocked = self.blocked.new_empty(0, self.blocked.shape[1])

    @property
    def packed(self) -> torch.Tensor:
        """The codes as uint8 ``[out, groups * 16]``, from whichever layout is held."""
        if getattr(self, "tiled", False):
            return untile_codes(self.tiles, self.out_features)
        return super().packed

    def set_rows(self, start: int, weight: Int4Weight) -> None:
        """As :meth:`Int4Linear.set_rows`, the tiles rebuilt after."""
        if not self.tiled:
            super().set_rows(start, weight)
            return
        self.blocked = block_codes(self.packed)
        self.tiled = False
        try:
            super().set_rows(start, weight)
        finally:
            self.tiled = True
            self._tile(unblock_codes(self.blocked, self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernel:
            return int4_q8_reference_linear(x, self.packed, self.scales, self.mins)
        flat = x.reshape(-1, self.in_features)
        if self.tiled:
            op = (
                torch.ops.graphrunner_int4.linear_q8_amx
                if self.path == AMX_PATH
                else torch.ops.graphrunner_int4.linear_q8_tiled
            )
            out = op(flat, self.tiles, self.tile_scales, self.tile_mins, self.out_features)
        else:
            out = torch.ops.graphrunner_int4.linear_q8(
                flat, self.blocked, self.scales, self.mins, self.path
            )
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        path = f"C++ {self.path_name} kernel" if self.kernel else "torch reference"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 groups of {GROUP} x int8 activations per group ({path})"
        )
