"""What a :class:`~graphrunner.GraphRunner` checks and resolves once, at
construction (its sizes, its mechanism, the backend's fill against the
declared buffers, the buffer that tells a batch's width) and after capture
(the graph of every raw size), and the width test of a replay."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner.core.replay import Graph
from graphrunner.declare.buffers import BufferSpec, PadRule, StaticBuffers, check_width
from graphrunner.declare.hooks import BaseGraphBackend
from graphrunner.mechanisms.base import Launcher
from graphrunner.sizing.sizes import default_capture_sizes, pad_to, validate_capture_sizes

__all__ = [
    "check_fill_matches_backend",
    "graph_table",
    "resolve_sizes",
    "width_field",
    "width_reason",
]


def resolve_sizes(capture_sizes: Sequence[int] | None, max_bs: int | None) -> list[int]:
    if capture_sizes is None:
        if max_bs is None:
            raise ValueError("give capture_sizes or max_bs")
        return default_capture_sizes(max_bs)
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
    """The graph every raw size ``1..max(sizes)`` replays (looked up once per replay)."""
    table = {}
    for raw_bs in range(1, sizes[-1] + 1):
        bs = pad_to(sizes, raw_bs)
        table[raw_bs] = Graph(bs, launchers[bs], buffers.view(bs))
    return table
