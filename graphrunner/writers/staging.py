"""A ring of pinned host tables and the one device table they are copied to.

Each buffer of the ring holds a table (int64 ``[rows, columns]``) and, after
it, an optional data region: the bytes of host-produced inputs, staged with
the table so that one copy carries both (kernels read them at
:attr:`TableStaging.data_address`, a fixed device address).

The host writes step N's table into the next pinned buffer of a ring and
copies it to the device with one asynchronous copy; before it writes a buffer
again, ``depth`` steps later, it waits for that buffer's last copy to have
finished reading it (an event recorded after each copy). With two buffers
that wait blocks a host running two steps ahead of a busy GPU; the default
ring of :data:`DEPTH` lets an engine run as far ahead as it likes in practice.
The device table has one fixed address, so a kernel captured in a CUDA graph
reads it at every replay; the copy into it and the kernels reading it are
ordered on one stream.

On the CPU (tests under Triton's interpreter) the buffers are plain host
tensors and the copy is a synchronous ``copy_``: the same path, no events.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DEPTH", "TableStaging"]

#: Pinned buffers in the ring (each one table: a few hundred bytes).
DEPTH = 8


class TableStaging:
    """An int64 ``[rows, columns]`` table (and ``data_bytes`` of staged input
    bytes after it) copied from the host to ``device``.

    Args:
        rows, columns: the table's shape.
        device: where the kernels reading :attr:`device_table` run.
        depth: pinned buffers in the ring (at least 2).
        data_bytes: bytes of the data region after the table (rounded up to 8).
    """

    def __init__(
        self,
        rows: int,
        columns: int,
        device: torch.device,
        *,
        depth: int = DEPTH,
        data_bytes: int = 0,
    ) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"depth={depth!r}: expected an int >= 2 (pinned buffers in the ring)")
        if isinstance(data_bytes, bool) or not isinstance(data_bytes, int) or data_bytes < 0:
            raise ValueError(f"data_bytes={data_bytes!r}: expected an int >= 0")
        self._cuda = device.type == "cuda"
        shape = (max(rows, 1), columns)
        table_words = shape[0] * columns
        words = table_words + -(-data_bytes // 8)
        host = [torch.zeros(words, dtype=torch.int64, pin_memory=self._cuda) for _ in range(depth)]
        self._host = host
        self._views: list[np.ndarray] = [h[:table_words].view(shape).numpy() for h in host]
        self._data = [h[table_words:].view(torch.uint8) for h in host]
        device_flat = torch.zeros(words, dtype=torch.int64, device=device)
        # What a step copies: the table alone, or the table and the data region.
        self._pairs = {
            False: [(device_flat[:table_words], h[:table_words]) for h in host],
            True: [(device_flat, h) for h in host],
        }
        self._events: list[torch.cuda.Event | None] = [None] * depth
        self._turn = 0
        # The stream copies are ordered on, looked up by its raw handle: one
        # C call a step instead of torch.cuda.current_stream()'s Python path
        # (about 15 us on an H100 host, more than the copy itself).
        self._device_index = _cuda_index(device) if self._cuda else -1
        self._raw_stream = -1
        self._stream: torch.cuda.Stream | None = None
        #: The table kernels read: one fixed address for the runner's lifetime.
        self.device_table = device_flat[:table_words].view(shape)
        #: Device address of the data region (fixed; 8-byte aligned).
        self.data_address = device_flat.data_ptr() + table_words * 8
        #: Copies issued (one per staged step).
        self.copies = 0

    def next_host(self) -> np.ndarray:
        """The host buffer to write this step's table into (a NumPy view of
        pinned memory), once the copy that last read it has finished."""
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        return self._views[self._turn]

    @property
    def depth(self) -> int:
        """Pinned buffers in the ring."""
        return len(self._host)

    @property
    def turn(self) -> int:
        """The ring buffer :meth:`next_host` returns (``0..depth-1``)."""
        return self._turn

    def host_data(self) -> torch.Tensor:
        """The data region (uint8 tensor) of the buffer :meth:`next_host` returned."""
        return self._data[self._turn]

    def upload(self, *, with_data: bool = False) -> torch.Tensor:
        """Copy the buffer written since :meth:`next_host` to the device
        (one asynchronous copy on the current stream: the table, and the data
        region too when ``with_data``); the next step writes the next buffer
        of the ring."""
        turn = self._turn
        dst, src = self._pairs[with_data][turn]
        dst.copy_(src, non_blocking=self._cuda)
        if self._cuda:
            event = self._events[turn]
            if event is None:
                event = self._events[turn] = torch.cuda.Event()
            event.record(self._current_stream())
        self._turn = (turn + 1) % len(self._host)
        self.copies += 1
        return self.device_table

    def _current_stream(self) -> torch.cuda.Stream:
        raw = torch._C._cuda_getCurrentRawStream(self._device_index)
        if raw != self._raw_stream or self._stream is None:
            self._stream = torch.cuda.current_stream(self._device_index)
            self._raw_stream = raw
        return self._stream


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
