"""The decode phase, declared once: its fields drive the batch, the protocol
and the static buffers.

:data:`DECODE_FIELDS` lists the device tensors of a decode step with their pad
rules (the design table); :data:`DECODE_HOST_MIRRORS` the host twins the
scheduler keeps in step. :class:`graphrunner.batch.decode_batch.DecodeBatch` takes its
slots, ``filter`` and ``merge`` from them, :func:`decode_buffer_specs` its
buffers, and a test checks that :class:`graphrunner.declare.inputs.DecodeInputs`
declares exactly these attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from graphrunner.declare.buffers import BufferSpec, Index, PadRule, check_width

__all__ = [
    "INPUT_IDS",
    "OUT_CACHE_LOC",
    "POSITIONS",
    "REQ_POOL_INDICES",
    "SEQ_LENS",
    "DECODE_FIELDS",
    "DECODE_HOST_MIRRORS",
    "DECODE_FIELD_NAMES",
    "MAMBA_DECODE_FIELDS",
    "PER_TOKEN_FIELD_NAMES",
    "decode_buffer_specs",
    "host_seq_lens_spec",
    "per_token_fields",
]

_I64 = torch.int64

#: The decode fields' names, written here only: every module that names one
#: (the batch, the sanitizer, the phases) imports it.
INPUT_IDS = "input_ids"
REQ_POOL_INDICES = "req_pool_indices"
SEQ_LENS = "seq_lens"
OUT_CACHE_LOC = "out_cache_loc"
POSITIONS = "positions"

#: Device tensors of a decode step (int64 ``[bs]``), with their pad rules;
#: ``seq_lens`` takes the backend's fill value in :func:`decode_buffer_specs`.
DECODE_FIELDS: tuple[BufferSpec, ...] = (
    BufferSpec(INPUT_IDS, _I64, PadRule.ZERO, index=True, indexes=Index.TOKEN),
    BufferSpec(REQ_POOL_INDICES, _I64, PadRule.ZERO, index=True, indexes=Index.REQUEST_ROW),
    BufferSpec(SEQ_LENS, _I64, PadRule.FILL, fill_value=1, backend_fill=True, indexes=Index.LENGTH),
    BufferSpec(OUT_CACHE_LOC, _I64, PadRule.ZERO, index=True, indexes=Index.KV_SLOT),
    BufferSpec(POSITIONS, _I64, PadRule.ZERO, index=True, indexes=Index.POSITION),
)
DECODE_FIELD_NAMES: tuple[str, ...] = tuple(s.name for s in DECODE_FIELDS)

#: The fields a model with Mamba layers adds (``decode_buffer_specs(mamba=True)``):
#: ``mamba_track_indices`` (int64 ``[bs]``), the Mamba pool slot whose state
#: each row reads and advances, 0 on padded rows; ``mamba_track_mask`` (bool
#: ``[bs]``), True where the row's state advances, False on padded rows, whose
#: update is discarded so the sink slot 0 stays bit-identical.
MAMBA_DECODE_FIELDS: tuple[BufferSpec, ...] = (
    BufferSpec("mamba_track_indices", _I64, PadRule.ZERO, index=True, indexes=Index.MAMBA_SLOT),
    BufferSpec("mamba_track_mask", torch.bool, PadRule.ZERO),
)

#: Device field -> its host mirror (CPU int64 ``[bs]``), equal to it at all times.
DECODE_HOST_MIRRORS: Mapping[str, str] = {
    REQ_POOL_INDICES: "req_pool_indices_cpu",
    SEQ_LENS: "seq_lens_cpu",
}

#: The decode fields a multi-token step (verify, EAGLE draft extend) holds per
#: token, ``W`` rows per request; the others stay per request.
PER_TOKEN_FIELD_NAMES: tuple[str, ...] = (INPUT_IDS, OUT_CACHE_LOC, POSITIONS)


def decode_buffer_specs(
    *,
    seq_len_fill_value: int = 1,
    host_seq_lens: bool = False,
    future: bool = False,
    mamba: bool = False,
    without: frozenset[str] = frozenset(),
) -> list[BufferSpec]:
    """The decode step's buffers with the pad rules of the design table.

    ``seq_len_fill_value`` is the attention backend's: padded rows read that
    many tokens through ``req_to_token`` row 0, i.e. the zeroed KV slot 0.
    ``host_seq_lens=True`` adds ``seq_lens_cpu``, a padded host buffer (same
    fill) for backends that plan on the host from the padded lengths.
    ``future=True`` lets ``input_ids`` hold future references (overlap
    scheduling: :mod:`graphrunner.core.future_map`), resolved by populate.
    ``mamba=True`` adds :data:`MAMBA_DECODE_FIELDS` (models with Mamba layers
    only: a Llama runner declares none of them). ``without`` names decode
    fields the phase does not read (frozen-KV MTP writes no ``out_cache_loc``).
    """
    specs = [
        dataclasses.replace(s, fill_value=seq_len_fill_value) if s.name == SEQ_LENS else s
        for s in DECODE_FIELDS
        if s.name not in without
    ]
    if future:
        specs = [dataclasses.replace(s, future=s.name == INPUT_IDS) for s in specs]
    if mamba:
        specs.extend(MAMBA_DECODE_FIELDS)
    if host_seq_lens:
        specs.append(host_seq_lens_spec(seq_len_fill_value))
    return specs


def host_seq_lens_spec(seq_len_fill_value: int = 1) -> BufferSpec:
    """``seq_lens_cpu`` as a padded host buffer (the backend's fill on padded
    rows), for backends that plan on the host from the padded lengths."""
    return BufferSpec(
        DECODE_HOST_MIRRORS[SEQ_LENS],
        _I64,
        PadRule.FILL,
        fill_value=seq_len_fill_value,
        host=True,
        backend_fill=True,
    )


def per_token_fields(width: int, *, without: frozenset[str] = frozenset()) -> list[BufferSpec]:
    """:data:`DECODE_FIELDS` for a step of ``width`` tokens per request (target
    verify, EAGLE draft extend), less the names in ``without``.

    The :data:`PER_TOKEN_FIELD_NAMES` take ``width`` rows per request (int64
    ``[bs * W]``); ``req_pool_indices`` stays per request (``[bs]``), and
    ``seq_lens`` (``[bs]``, the length after the step) pads with ``W``: a
    padded row is ``W`` tokens at slot 0 and its prefix ``seq_lens - W`` is 0,
    never negative. Every other rule is decode's.
    """
    check_width("width", width)
    specs = []
    for s in DECODE_FIELDS:
        if s.name in without:
            continue
        if s.name in PER_TOKEN_FIELD_NAMES:
            s = dataclasses.replace(s, rows_per_request=width)
        elif s.name == SEQ_LENS:
            s = dataclasses.replace(
                s, rule=PadRule.WIDTH, fill_value=None, width=width, backend_fill=False
            )
        specs.append(s)
    return specs
