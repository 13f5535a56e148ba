"""The decode phase as a value: one token per request on
:func:`~graphrunner.declare.decode.decode_buffer_specs`."""

from __future__ import annotations

from graphrunner.declare.decode import decode_buffer_specs
from graphrunner.declare.hooks import GraphBackend, NullBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.mechanisms.base import ForwardFn
from graphrunner.phases.base import Phase

__all__ = ["decode_phase"]


def decode_phase(
    forward: ForwardFn,
    *,
    backend: GraphBackend | None = None,
    outputs: OutputsDecl | None = None,
    host_seq_lens: bool = False,
    future: bool = False,
    mamba: bool = False,
) -> Phase:
    """``forward`` over the decode buffers (int64 ``[bs]`` each, see
    :func:`~graphrunner.declare.decode.decode_buffer_specs` for the flags),
    ``seq_lens`` padded with the backend's fill value."""
    fill = (backend if backend is not None else NullBackend()).seq_len_fill_value
    specs = decode_buffer_specs(
        seq_len_fill_value=fill, host_seq_lens=host_seq_lens, future=future, mamba=mamba
    )
    return Phase("decode", forward, tuple(specs), outputs=outputs, backend=backend)
