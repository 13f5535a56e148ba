"""GGUF's 4-bit blocks as ``--quantize int4`` weights, their codes kept.

Q4_0, Q4_1 and Q4_K store 4-bit codes in groups of 32 weights with one scale
and one offset a group, which is int4's format
(:class:`~graphrunner_ref.model.int4_linear.Int4Weight`) up to byte order:

* ``Q4_1``: 20-byte blocks ``d (f16), m (f16), 16 code bytes``,
  ``w = q * d + m``, byte ``j`` holding codes ``j`` (low nibble) and
  ``j + 16`` (high), as int4 does: scale ``d``, min ``m``, the bytes as they are.
* ``Q4_0``: 18-byte blocks ``d (f16), 16 code bytes``, ``w = (q - 8) * d``:
  scale ``d``, min ``-8 d``.
* ``Q4_K``: 144-byte super-blocks of 256 weights, ``d, dmin (f16)``, 12 bytes
  of 6-bit sub-scales ``sc`` and sub-mins ``m``, 128 code bytes; sub-block
  ``s`` (32 weights) has scale ``d * sc[s]`` and min ``-dmin * m[s]``, its
  codes in the low (even ``s``) or high (odd ``s``) nibbles of code bytes
  ``32 (s // 2) ..``: repacked into int4's order.

Each scale and min above is exact in float32 (a half times a small integer),
so the imported weight dequantizes to what the ``gguf`` package's own
dequantization gives, bit for bit: the file's 4-bit weights run as they are,
not requantized from floats. Q and K rows are put back in Hugging Face order
(:func:`~graphrunner_ref.io.gguf_import.unpermute_qk`), whole rows, as the
float import does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphrunner.util import needs_extra
from graphrunner_ref.io.gguf_import import gguf_config, hf_tensor_name, open_gguf, unpermute_qk
from graphrunner_ref.io.gguf_meta import GGUFImportError
from graphrunner_ref.model.int4_linear import GROUP, Int4Weight

__all__ = ["INT4_TYPES", "blocks_as_int4", "read_gguf_int4"]

#: GGUF tensor types whose codes int4 takes as they are.
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Bytes per block of each type.
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def _halves(raw: np.ndarray, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block (``raw`` uint8 ``[blocks, bytes]``),
    as float32 ``[blocks]``."""
    half = np.ascontiguousarray(raw[:, start : start + 2]).view(np.float16)[:, 0]
    return torch.from_numpy(half.astype(np.float32))


def _legacy(raw: np.ndarray, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 blocks ``[blocks, 18 | 20]``: codes uint8 ``[blocks, 16]``,
    scales and mins float32 ``[blocks]``."""
    d = _halves(raw, 0)
    if kind == "Q4_0":
        return torch.from_numpy(raw[:, 2:].copy()), d, d * -8.0
    return torch.from_numpy(raw[:, 4:].copy()), d, _halves(raw, 2)


def _k_quant(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks ``[supers, 144]``: codes uint8 ``[supers * 8, 16]`` in
    int4's order, scales and mins float32 ``[supers * 8]``."""
    with needs_extra("gguf", "GGUF import"):
        from gguf.quants import Q4_K

    d, dmin = _halves(raw, 0), _halves(raw, 2)
    sc, m = (torch.from_numpy(a.astype(np.float32)) for a in Q4_K.get_scale_min(raw[:, 4:16]))
    scales = (d[:, None] * sc).reshape(-1)
    mins = -(dmin[:, None] * m).reshape(-1)
    code_bytes = torch.from_numpy(raw[:, 16:].copy()).view(-1, 4, 32)  # 4 chunks of 64 weights
    # Chunk c holds sub-block 2c in its low nibbles and 2c + 1 in its high ones.
    codes = torch.stack([code_bytes & 0x0F, code_bytes >> 4], dim=2).reshape(-1, GROUP)
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    return packed, scales, mins


def blocks_as_int4(data: np.ndarray, kind: str, rows: int) -> Int4Weight:
    """A GGUF tensor's blocks (``data`` uint8, ``rows`` rows of whole blocks,
    as the ``gguf`` reader gives them) of type ``kind`` (an :data:`INT4_TYPES`
    name) as an :class:`Int4Weight` of ``rows`` output rows."""
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"blocks_as_int4: kind={kind!r}: expected one of {', '.join(INT4_TYPES)}")
    raw = np.asarray(data, dtype=np.uint8).reshape(-1, _BLOCK_BYTES[kind])
    packed, scales, mins = _k_quant(raw) if kind == "Q4_K" else _legacy(raw, kind)
    return Int4Weight(
        packed.reshape(rows, -1).contiguous(),
        scales.reshape(rows, -1).contiguous(),
        mins.reshape(rows, -1).contiguous(),
    )


def read_gguf_int4(path: str | Path, reader: Any = None) -> dict[str, Int4Weight]:
    """Every Q4_0 / Q4_1 / Q4_K projection of the layers of Llama GGUF file ``path`` as an
    :class:`Int4Weight`, by transformers name (``model.layers.0.mlp.up_proj.weight``),
    Q and K rows in Hugging Face order; tensors of other types are left out
    (the caller quantizes those from their float weights). ``reader``: an
    open ``GGUFReader`` of ``path``, to skip reading the header again.
    Raises :class:`GGUFImportError` naming what does not fit."""
    reader = open_gguf(path) if reader is None else reader
    config = gguf_config(reader)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights: dict[str, Int4Weight] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        # The embedding is a lookup and int4's LM head keeps float16 weights:
        # only the layers' projections run 4-bit.
        if kind not in INT4_TYPES or not t.name.startswith("blk."):
            continue
        name = hf_tensor_name(t.name, config["num_hidden_layers"])
        rows = int(t.shape[-1])  # ggml lists the input (fastest) dimension first
        try:
            weight = blocks_as_int4(t.data, kind, rows)
        except (ValueError, RuntimeError) as e:  # a short block in a truncated file
            raise GGUFImportError(f"GGUF tensor {t.name!r} cannot be read: {e}") from None
        part = t.name.split(".")[2]
        if part in heads:
            weight = Int4Weight(*(unpermute_qk(x, heads[part]).contiguous() for x in weight))
        weights[name] = weight
    return weights
