"""What a :class:`~graphrunner.GraphRunner` checks and resolves once, at
construction (its sizes, its mechanism, the backend's fill against the
declared buffers, the buffer that tells a batch's width) and after capture
(the graph of every raw size), and the width test of a replay."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner.core.replay import Graph
from graphrunner.declare.buffers import Axis, BufferSpec, PadRule, StaticBuffers, check_width
from graphrunner.declare.hooks import BaseGraphBackend
from graphrunner.mechanisms.base import Launcher
from graphrunner.sizing.sizes import (
    default_capture_sizes,
    default_token_sizes,
    pad_to,
    validate_capture_sizes,
)
from graphrunner.writers.plan import PopulateError

__all__ = [
    "check_fill_matches_backend",
    "graph_table",
    "resolve_sizes",
    "width_field",
    "width_reason",
]


def resolve_sizes(
    capture_sizes: Sequence[int] | None, max_bs: int | None, *, tokens: bool = False
) -> list[int]:
    """The sizes to capture (``tokens``: a token batch's token counts)."""
    if capture_sizes is None:
        if max_bs is None:
            raise ValueError("give capture_sizes or max_bs")
        return default_token_sizes(max_bs) if tokens else default_capture_sizes(max_bs)
    sizes = validate_capture_sizes(capture_sizes)
    if max_bs is not None and max_bs != sizes[-1]:
        raise ValueError(f"max_bs={max_bs} disagrees with the largest capture size {sizes[-1]}")
    return sizes


def check_fill_matches_backend(specs: Sequence[BufferSpec], backend: BaseGraphBackend) -> None:
    # A seq_lens fill that differs from the backend's would send padded rows
    # somewhere the backend did not plan for.
    for spec in specs:
        is_backend_fill = spec.backend_fill and spec.rule is PadRule.FILL
        if is_backend_fill and spec.fill_value != backend.seq_len_fill_value:
            raise ValueError(
                f"{spec.name} fill_value {spec.fill_value} differs from the backend's "
                f"seq_len_fill_value {backend.seq_len_fill_value}"
            )


def width_field(specs: Sequence[BufferSpec], width: int) -> str:
    check_width("width", width)
    for spec in specs:
        if spec.rows_per_request == width and not spec.host:
            return spec.name
    raise ValueError(f"width={width}; expected a device buffer of rows_per_request={width}")


def token_field(specs: Sequence[BufferSpec]) -> str:
    """The token-axis device buffer whose live rows count a token batch's tokens."""
    for spec in specs:
        if spec.axis is Axis.TOKEN and not spec.host and spec.rows_per_request == 1:
            return spec.name
    raise ValueError("a token batch needs a device buffer of one row per token on Axis.TOKEN")


def token_count(inputs: object, field: str, requests: int) -> int:
    """A token batch's live tokens: the rows of its ``field`` input (a host
    shape, never a device read), at least its ``requests``."""
    t = getattr(inputs, field, None)
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise PopulateError(
            f"input {field!r} is {shape}; a token batch takes a 1-D tensor of its live tokens"
        )
    tokens = int(t.shape[0])
    if tokens < requests:
        raise PopulateError(
            f"input {field!r} holds {tokens} tokens for {requests} requests; every "
            f"request of a token batch owns at least one token"
        )
    return tokens


def width_reason(inputs: object, field: str | None, width: int | None, raw_bs: int) -> str | None:
    """Why ``inputs`` cannot replay a graph captured at ``width`` tokens per
    request (host shapes only: ``field``'s rows over ``raw_bs``), or None
    (also for a runner of no width: ``field`` or ``width`` None)."""
    if field is None or width is None:
        return None
    t = getattr(inputs, field, None)
    if isinstance(t, torch.Tensor) and t.dim() > 0 and raw_bs >= 1:
        got = int(t.shape[0]) // raw_bs
        if got != width:
            return f"batch width {got} differs from the captured width {width}"
    return None


def graph_table(
    launchers: dict[int, Launcher], sizes: Sequence[int], buffers: StaticBuffers
) -> dict[int, Graph]:
    """The graph every raw size ``1..max(sizes)`` replays (looked up once per
    replay; a token batch's raw size is its live tokens)."""
    table = {}
    for raw_bs in range(1, sizes[-1] + 1):
        bs = pad_to(sizes, raw_bs)
        table[raw_bs] = Graph(buffers.size_of(bs), launchers[bs], buffers.view(bs))
    return table
