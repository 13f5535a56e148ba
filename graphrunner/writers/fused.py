"""The fused populate: every device buffer written by one Triton launch.

A second executor of the same declarations as the torch writer
(:func:`graphrunner.writers.base.write_sources`), which stays the reference: the
table of operations is built from each :class:`~graphrunner.declare.buffers.BufferSpec`
(``rows``, ``pad_value``, ``future``) and nothing else, and the kernel copies
bits and writes bit patterns, so the result equals the torch writer bit for
bit for any dtype. Host buffers (``host=True``) keep the torch writer: they
are host memory, no launch.

Per step the host writes one table row per device buffer (the source
address, and the planned destination, live and total bytes, pad pattern)
into a pinned staging buffer, copies it to the device with one asynchronous
copy (:class:`~graphrunner.writers.staging.TableStaging`, a ring of pinned buffers), and
launches the kernel once: two device operations, whatever the declaration.

:class:`InGraphPopulate` goes one step further: the kernel is captured inside
each CUDA graph, reading the fixed device table, so a replay is the host's
table write, one copy and the graph launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from graphrunner.declare.buffers import BufferSpec, Size, StaticBuffers
from graphrunner.writers.base import write_sources
from graphrunner.writers.fused_kernel import BLOCK, COLUMNS, ROW, kernel
from graphrunner.writers.plan import plan_for
from graphrunner.writers.staging import TableStaging

__all__ = ["FusedPopulate", "InGraphPopulate", "pad_pattern"]

_DST, _SRC, _LIVE, _TOTAL = COLUMNS["dst"], COLUMNS["src"], COLUMNS["live"], COLUMNS["total"]
_PATTERN, _WIDE, _FUTURE = COLUMNS["pattern"], COLUMNS["wide"], COLUMNS["future"]


def pad_pattern(spec: BufferSpec) -> int:
    """The pad value's bytes repeated to 8, as an int64 (0 for KEEP, which
    writes no tail). The value is the spec's own :meth:`BufferSpec.pad_value`,
    converted by torch as ``fill_`` converts it."""
    value = spec.pad_value()
    if value is None or value == 0:
        # The torch writer zeroes every tail whose value equals 0 (one zero op
        # per group), so a fill of -0.0 pads with +0.0 there, and here.
        return 0
    element = torch.tensor(value, dtype=spec.dtype).reshape(1).view(torch.uint8)
    word = element.repeat(8 // element.numel())
    return int(word.view(torch.int64).item())


def _element_size(spec: BufferSpec) -> int:
    return torch.empty((), dtype=spec.dtype).element_size()


@dataclass(frozen=True, slots=True)
class _Table:
    """The static part of one ``(raw_bs, bs)`` table, and its launch grid."""

    rows: np.ndarray  # int64 [device buffers, ROW], source addresses left 0
    grid: tuple[int, int]


class FusedPopulate:
    """Populates a runner's device buffers with one Triton launch per step.

    Args:
        buffers: the runner's static buffers; every device buffer's element
            size must divide 8 (1, 2, 4 or 8 bytes: every integer, float and
            bool dtype; not complex128).
        block: bytes (or words) per program; small grids for the interpreter.

    On a CPU device the kernel runs under Triton's interpreter (tests); CPU
    and eager runners use the torch writer.
    """

    def __init__(self, buffers: StaticBuffers, *, block: int = BLOCK) -> None:
        for spec in buffers.specs:
            if not spec.host and 8 % _element_size(spec):
                raise ValueError(
                    f"buffer {spec.name!r}: dtype {spec.dtype} has "
                    f"{_element_size(spec)}-byte elements; the fused populate takes element "
                    f"sizes that divide 8 (use the torch populate)"
                )
        self.buffers = buffers
        self.block = block
        self._index = tuple(i for i, s in enumerate(buffers.specs) if not s.host)
        self._has_host = len(self._index) < len(buffers.specs)
        self._offsets, data_bytes = _data_offsets(buffers, self._index)
        self.staging = TableStaging(len(self._index), ROW, buffers.device, data_bytes=data_bytes)
        self._future = (
            buffers.future_tokens
            if buffers.future_tokens is not None
            else self.staging.device_table
        )
        self._interpret = buffers.device.type != "cuda"
        self._tables: dict[tuple[int, int], _Table] = {}
        self._stage_views: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        self._dense: list[torch.Tensor] = []
        #: Kernel launches issued (tests and benches read it).
        self.launches = 0

    def write(self, sources: Sequence[torch.Tensor], raw_bs: Size, bs: Size) -> int:
        """Write validated ``sources`` (one per spec, declaration order;
        empty when ``raw_bs == 0``): stage the table, launch once, write the
        host buffers with torch. Returns the device operations issued."""
        assert isinstance(raw_bs, int) and isinstance(bs, int)  # one axis (checked at bind)
        table = self.stage(sources, raw_bs, bs)
        self.launch(table.grid)
        return 2 + self._write_host(sources, raw_bs, bs)

    def stage(self, sources: Sequence[torch.Tensor], raw_bs: int, bs: int) -> _Table:
        """Write this step's table into the pinned buffer and copy it to the
        device table (one asynchronous copy)."""
        table = self._table(raw_bs, bs)
        rows = self.staging.next_host()
        rows[: len(table.rows)] = table.rows
        dense: list[torch.Tensor] = []
        staged: list[tuple[int, torch.Tensor]] = []
        for k, i in enumerate(self._index if raw_bs else ()):
            src = sources[i]
            if self._offsets[k] >= 0 and src.is_cpu:
                # Host-produced: its bytes ride in the table's copy (the
                # table's source address is already its data slot).
                staged.append((k, src))
                continue
            if not src.is_contiguous():
                src = src.contiguous()  # a bit copy needs dense rows
                dense.append(src)  # alive until the kernel has read it
            address = src.data_ptr()
            rows[k, _SRC] = address
            if address & 7:
                rows[k, _WIDE] = 0
        if staged:
            views = self._staged_views(raw_bs)
            # Host to host, one call for every staged field.
            torch._foreach_copy_([views[k] for k, _ in staged], [src for _, src in staged])
        self.staging.upload(with_data=bool(staged))
        # The dense copies must outlive the launch (for the in-graph writer:
        # the graph launch after this call); the next step replaces them.
        self._dense = dense
        return table

    def _staged_views(self, raw_bs: int) -> dict[int, torch.Tensor]:
        """By table row, each buffer that takes host inputs: its ``raw_bs``
        live rows' slot in the data region of this step's ring buffer (typed,
        shaped as the source). Cached per (ring buffer, size)."""
        key = (self.staging.turn, raw_bs)
        views = self._stage_views.get(key)
        if views is None:
            data = self.staging.host_data()
            views = {}
            for k, i in enumerate(self._index):
                spec, offset = self.buffers.specs[i], self._offsets[k]
                if offset >= 0:
                    rows = spec.rows(raw_bs)
                    size = _element_size(spec) * rows * math.prod(spec.extra_shape)
                    typed = data[offset : offset + size].view(spec.dtype)
                    views[k] = typed.view(rows, *spec.extra_shape)
            self._stage_views[key] = views
        return views

    def _write_host(self, sources: Sequence[torch.Tensor], raw_bs: int, bs: int) -> int:
        if not self._has_host:
            return 0
        return write_sources(self.buffers, sources, raw_bs, bs, host_only=True)

    def grid(self, raw_bs: int, bs: int) -> tuple[int, int]:
        """The launch grid of ``(raw_bs, bs)``: (device buffers, blocks of the longest)."""
        return self._table(raw_bs, bs).grid

    def launch(self, grid: tuple[int, int]) -> None:
        """One launch of the kernel on the device table as it stands."""
        fn = kernel(self._interpret)
        fn[grid](self.staging.device_table, self._future, ROW=ROW, BLOCK=self.block)
        self.launches += 1

    def _table(self, raw_bs: int, bs: int) -> _Table:
        table = self._tables.get((raw_bs, bs))
        if table is None:
            plan_for(self.buffers, raw_bs, bs)  # the same size checks as the torch writer
            table = self._tables[(raw_bs, bs)] = self._make_table(raw_bs, bs)
        return table

    def _make_table(self, raw_bs: int, bs: int) -> _Table:
        specs = self.buffers.specs
        rows = np.zeros((len(self._index), ROW), dtype=np.int64)
        longest = 0
        for k, i in enumerate(self._index):
            spec = specs[i]
            buf = self.buffers.tensors[spec.name]
            row_bytes = buf[:1].numel() * buf.element_size()  # one row of extra_shape
            live = spec.rows(raw_bs) * row_bytes
            total = spec.rows(bs) * row_bytes if spec.pad_value() is not None else live
            dst = buf.data_ptr()
            rows[k, _DST] = dst
            # A host-produced input is read from its data slot; a device one's
            # address is set per step (never read while live == 0).
            offset = self._offsets[k]
            rows[k, _SRC] = dst if offset < 0 else self.staging.data_address + offset
            rows[k, _LIVE], rows[k, _TOTAL] = live, total
            rows[k, _PATTERN] = pad_pattern(spec)
            rows[k, _WIDE] = int((dst | live | total) & 7 == 0)
            rows[k, _FUTURE] = int(spec.future)
            # Sized by the captured rows whatever the rule, so every raw size
            # of ``bs`` gets the same grid: the one an in-graph launch was
            # captured with must reach a KEEP buffer's live rows too.
            longest = max(longest, spec.rows(bs) * row_bytes)
        blocks = max(1, -(-longest // self.block))
        return _Table(rows, (max(1, len(self._index)), blocks))


def _data_offsets(buffers: StaticBuffers, index: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Where each device buffer's host-produced input is staged in the data
    region (8-byte aligned, sized for ``max_bs``; -1 for a buffer that takes
    device inputs only), and the region's bytes."""
    offsets, end = [], 0
    for i in index:
        spec = buffers.specs[i]
        if not spec.takes_host_source:
            offsets.append(-1)
            continue
        buf = buffers.tensors[spec.name]
        offsets.append(end)
        end += -(-(buf.numel() * buf.element_size()) // 8) * 8
    return tuple(offsets), end


class InGraphPopulate(FusedPopulate):
    """The fused populate captured inside each CUDA graph.

    At capture, :meth:`before_capture` stages size ``bs``'s all-padding table
    and :meth:`launch_captured` is recorded in the graph ahead of the
    forward; at replay, :meth:`write` stages the table (one copy into the
    fixed device table) and the graph's own kernel applies it.
    """

    def __init__(self, buffers: StaticBuffers, *, block: int = BLOCK) -> None:
        super().__init__(buffers, block=block)
        self._staged = False  # a table was staged for the next graph launch

    def before_capture(self, bs: int) -> None:
        """Stage the all-padding table of size ``bs`` (capture and warm-up run it)."""
        self.stage([], 0, bs)

    def launch_captured(self, bs: int) -> None:
        """The launch recorded in size ``bs``'s graph (its grid covers ``bs``)."""
        self.launch(self.grid(0, bs))

    def write(self, sources: Sequence[torch.Tensor], raw_bs: Size, bs: Size) -> int:
        assert isinstance(raw_bs, int) and isinstance(bs, int)  # one axis (checked at bind)
        self.stage(sources, raw_bs, bs)
        self._staged = True
        return 1 + self._write_host(sources, raw_bs, bs)

    def before_replay(self) -> None:
        """Called before every graph launch: a launch with no table staged
        since the last one (``runner.relaunch``) stages an empty table, so
        it leaves the buffers as they are instead of re-reading the last
        step's sources, which may be gone."""
        if not self._staged:
            self.staging.next_host()[:] = 0  # live = total = 0: every row a no-op
            self.staging.upload()
        self._staged = False
