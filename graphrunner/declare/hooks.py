"""The attention backend's side of capture and replay.

Backends that keep metadata outside the model's inputs (page tables, split
plans, workspace) implement these hooks, in the plan/run split: allocation and
host-side planning happen here, outside the graph; the captured forward only
reads the state they prepared.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from graphrunner.declare.buffers import BufferView, Size

__all__ = [
    "OPTIONAL_HOOKS",
    "REQUIRED_HOOKS",
    "BaseGraphBackend",
    "GraphBackend",
    "NullBackend",
    "as_graph_backend",
]

#: What every backend defines; a runner refuses a backend lacking one.
REQUIRED_HOOKS = (
    "seq_len_fill_value",
    "init_graph_state",
    "init_capture_metadata",
    "init_replay_metadata",
)
#: Hooks added since the first protocol: a backend without them gets the
#: default (:class:`NullBackend`'s), so one written against the older
#: protocol keeps working.
OPTIONAL_HOOKS = ("validate_inputs",)


@runtime_checkable
class BaseGraphBackend(Protocol):
    """The required hooks a runner calls on the model's attention backend
    (the first protocol; :class:`GraphBackend` adds the optional ones)."""

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

    def init_replay_metadata(
        self, bs: Size, raw_bs: Size, view: BufferView, inputs: object
    ) -> None:
        """Update metadata outside the graph before replaying size ``bs``.

        ``view`` is already populated; ``inputs`` carries the host mirrors
        (``seq_lens_cpu``, ``req_pool_indices_cpu``). Must not sync the device.
        Not called for an eager fallback (its forward plans its own metadata).
        """
        ...


@runtime_checkable
class GraphBackend(BaseGraphBackend, Protocol):
    """Hooks a runner calls on the model's attention backend: the required
    ones of :class:`BaseGraphBackend` and the optional ones below (a backend
    lacking one gets its default through :func:`as_graph_backend`)."""

    def validate_inputs(self, raw_bs: Size, inputs: object) -> None:
        """Refuse inputs this backend cannot run, from host values only (the
        host mirrors ``seq_lens_cpu``, ``req_pool_indices_cpu``); called before
        every step, graph replay and eager fallback alike. Must not sync the
        device. Optional: the default accepts everything.
        """
        ...


class NullBackend:
    """For models whose forward needs no metadata beyond the static buffers."""

    seq_len_fill_value: int = 1
    #: Nothing is planned on the host per step (a multi-step phase accepts it).
    metadata_on_device: bool = True

    def init_graph_state(self, max_bs: int) -> None:
        pass

    def init_capture_metadata(self, bs: int, view: BufferView) -> None:
        pass

    def validate_inputs(self, raw_bs: Size, inputs: object) -> None:
        pass

    def init_replay_metadata(
        self, bs: Size, raw_bs: Size, view: BufferView, inputs: object
    ) -> None:
        pass


class _WithDefaults:
    """A backend of the older protocol, given the optional hooks' defaults."""

    def __init__(self, backend: BaseGraphBackend) -> None:
        self.wrapped = backend

    @property
    def seq_len_fill_value(self) -> int:
        return self.wrapped.seq_len_fill_value

    def init_graph_state(self, max_bs: int) -> None:
        self.wrapped.init_graph_state(max_bs)

    def init_capture_metadata(self, bs: int, view: BufferView) -> None:
        self.wrapped.init_capture_metadata(bs, view)

    def validate_inputs(self, raw_bs: Size, inputs: object) -> None:
        pass

    def init_replay_metadata(
        self, bs: Size, raw_bs: Size, view: BufferView, inputs: object
    ) -> None:
        self.wrapped.init_replay_metadata(bs, raw_bs, view, inputs)


def as_graph_backend(backend: BaseGraphBackend) -> GraphBackend:
    """``backend`` as a full :class:`GraphBackend`: itself when it defines
    every hook, else wrapped with the optional hooks' defaults.

    Raises:
        TypeError: ``backend`` lacks a required hook (named, with its class).
    """
    missing = [name for name in REQUIRED_HOOKS if not _defines(backend, name)]
    if missing:
        raise TypeError(
            f"backend {type(backend).__name__} does not define {', '.join(missing)}: a "
            f"GraphBackend needs {', '.join(REQUIRED_HOOKS)} "
            f"(optional: {', '.join(OPTIONAL_HOOKS)})"
        )
    if isinstance(backend, GraphBackend):  # construction time only: not on the hot path
        return backend
    return _WithDefaults(backend)


def _defines(backend: object, name: str) -> bool:
    if name == "seq_len_fill_value":  # an attribute or a property
        return hasattr(backend, name)
    return callable(getattr(backend, name, None))
