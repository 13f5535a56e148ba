"""One Triton launch that writes every device buffer of a populate.

The kernel knows nothing of pad rules: it executes a table of declared
operations, one row per device buffer, that
:mod:`graphrunner.writers.fused` builds from the same
:class:`~graphrunner.declare.buffers.BufferSpec` declarations the torch populate
reads. Each row (int64 ``[ROW]``) says, in bytes:

    dst, src:  addresses of the buffer and of its live source rows
    live:      bytes of live rows to copy (``spec.rows(raw_bs)`` rows)
    total:     bytes of the captured rows (``spec.rows(bs)``); ``[live:total]``
               is the padded tail, written with ``pattern``
    pattern:   8 bytes: the pad value's bytes repeated (element sizes 1, 2,
               4, 8 divide 8, so byte ``j`` of the tail is ``pattern`` byte
               ``j % 8``); ``total == live`` for a KEEP buffer
    wide:      1 when dst, src, live and total are multiples of 8: copy and
               pad in int64 words instead of bytes
    future:    1 for a buffer declared ``future=True`` (int64 ids): live
               values ``-r`` are replaced by ``future_tokens[r]``

Grid: ``(rows of the table, blocks)``; program ``(i, b)`` handles bytes (or
words) ``[b * BLOCK, (b + 1) * BLOCK)`` of buffer ``i``. Copies are bit
copies and pads are bit patterns, so the result equals the torch populate bit
for bit for any dtype.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from graphrunner.util.extras import needs_extra

# Without the [cuda] extra the module still imports (its pure-torch helpers,
# the kernel bodies as plain functions); launching a kernel names the extra
# (the bodies read `tl` only when Triton compiles or interprets them).
with contextlib.suppress(ModuleNotFoundError):
    import triton.language as tl

__all__ = ["BLOCK", "COLUMNS", "ROW", "kernel"]

#: Column of each field in a table row.
COLUMNS = {"dst": 0, "src": 1, "live": 2, "total": 3, "pattern": 4, "wide": 5, "future": 6}
#: int64 entries per table row (one spare keeps rows 64-byte aligned).
ROW = 8
#: Bytes (or words) one program handles.
BLOCK = 1024


def _populate(
    table_ptr: tl.tensor, future_ptr: tl.tensor, ROW: tl.constexpr, BLOCK: tl.constexpr
) -> None:
    row = table_ptr + tl.program_id(0) * ROW
    dst_addr = tl.load(row + 0)
    src_addr = tl.load(row + 1)
    live = tl.load(row + 2)
    total = tl.load(row + 3)
    pattern = tl.load(row + 4)
    wide = tl.load(row + 5)
    future = tl.load(row + 6)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    if future != 0:
        # int64 ids; future references -r read future_tokens[r].
        dst64 = dst_addr.to(tl.pointer_type(tl.int64))
        src64 = src_addr.to(tl.pointer_type(tl.int64))
        n_live = live // 8
        in_live = offs < n_live
        ids = tl.load(src64 + offs, mask=in_live, other=0)
        is_ref = in_live & (ids < 0)
        refs = tl.load(future_ptr + tl.maximum(-ids, 0), mask=is_ref, other=0)
        tl.store(dst64 + offs, tl.where(ids < 0, refs, ids), mask=in_live)
        in_tail = (offs >= n_live) & (offs < total // 8)
        tl.store(dst64 + offs, tl.full([BLOCK], 0, tl.int64) + pattern, mask=in_tail)
    elif wide != 0:
        dst_w = dst_addr.to(tl.pointer_type(tl.int64))
        src_w = src_addr.to(tl.pointer_type(tl.int64))
        n_live = live // 8
        in_live = offs < n_live
        tl.store(dst_w + offs, tl.load(src_w + offs, mask=in_live, other=0), mask=in_live)
        in_tail = (offs >= n_live) & (offs < total // 8)
        tl.store(dst_w + offs, tl.full([BLOCK], 0, tl.int64) + pattern, mask=in_tail)
    else:
        dst_b = dst_addr.to(tl.pointer_type(tl.uint8))
        src_b = src_addr.to(tl.pointer_type(tl.uint8))
        in_live = offs < live
        tl.store(dst_b + offs, tl.load(src_b + offs, mask=in_live, other=0), mask=in_live)
        in_tail = (offs >= live) & (offs < total)
        tail = ((pattern >> ((offs % 8) * 8)) & 0xFF).to(tl.uint8)
        tl.store(dst_b + offs, tail, mask=in_tail)


@functools.cache
def kernel(interpret: bool) -> Any:
    """The kernel, compiled for the GPU or run by Triton's interpreter on the
    CPU. Chosen per call by the tensors' device, not by ``TRITON_INTERPRET``
    at import, so CPU tests and GPU runs share one process."""
    with needs_extra("cuda", 'populate="fused" and populate="graph"'):
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            return InterpretedFunction(_populate)
        import triton

        return triton.jit(_populate)
