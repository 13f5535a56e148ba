"""The attention backend's side of capture and replay.

Backends that keep metadata outside the model's inputs (page tables, split
plans, workspace) implement these hooks, in the plan/run split: allocation and
host-side planning happen here, outside the graph; the captured forward only
reads the state they prepared.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from graphrunner.declare.buffers import BufferView

__all__ = ["GraphBackend", "NullBackend"]


@runtime_checkable
class GraphBackend(Protocol):
    """Hooks a runner calls on the model's attention backend."""

    @property
    def seq_len_fill_value(self) -> int:
        """``seq_lens`` on padded rows: tokens a padded row reads via slot 0 (>= 1)."""
        ...

    def init_graph_state(self, max_bs: int) -> None:
        """Allocate graph-lifetime state once, for up to ``max_bs`` requests."""
        ...

    def init_capture_metadata(self, bs: int, view: BufferView) -> None:
        """Prepare metadata for capturing size ``bs`` (``view`` is all padding)."""
        ...

    def validate_inputs(self, raw_bs: int, inputs: object) -> None:
        """Refuse inputs this backend cannot run, from host values only (the
        host mirrors ``seq_lens_cpu``, ``req_pool_indices_cpu``); called before
        every step, graph replay and eager fallback alike. Must not sync the device.
        """
        ...

    def init_replay_metadata(self, bs: int, raw_bs: int, view: BufferView, inputs: object) -> None:
        """Update metadata outside the graph before replaying size ``bs``.

        ``view`` is already populated; ``inputs`` carries the host mirrors
        (``seq_lens_cpu``, ``req_pool_indices_cpu``). Must not sync the device.
        Not called for an eager fallback (its forward plans its own metadata).
        """
        ...


class NullBackend:
    """For models whose forward needs no metadata beyond the static buffers."""

    seq_len_fill_value: int = 1

    def init_graph_state(self, max_bs: int) -> None:
        pass

    def init_capture_metadata(self, bs: int, view: BufferView) -> None:
        pass

    def validate_inputs(self, raw_bs: int, inputs: object) -> None:
        pass

    def init_replay_metadata(self, bs: int, raw_bs: int, view: BufferView, inputs: object) -> None:
        pass
