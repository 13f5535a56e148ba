"""Static buffers, each declared once with the rule for its padded rows.

A graph is captured over fixed addresses, so every input lives in a buffer
allocated once at the largest captured size. What the padded tail of each
buffer holds is data here (a :class:`PadRule`), applied by
:func:`graphrunner.writers.base.populate` and nowhere else.

Each buffer declares its own rows per request: 1 for per-request fields
(``seq_lens``), ``W`` for per-token fields of a speculative phase (``W`` draft
tokens per request), ``k`` for per-candidate fields (top-k). One runner holds
any mix of them. A buffer may also live on the host (``host=True``): a padded
host copy for backends that plan on the CPU (``seq_lens_cpu``), written by
populate like every other buffer. A device buffer of integer or bool dtype
also takes a host-produced input (:attr:`BufferSpec.takes_host_source`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

import torch

from graphrunner.declare.indexes import Index
from graphrunner.declare.packs import BufferPack, allocate_packed

__all__ = [
    "Axis",
    "BufferSpec",
    "BufferView",
    "Index",
    "PadRule",
    "Size",
    "StaticBuffers",
    "StepSize",
    "check_width",
    "fits",
    "has_rows",
    "place",
    "units",
]


class PadRule(enum.Enum):
    """What a buffer holds on padded rows ``[raw_bs:bs]``."""

    ZERO = "zero"  # indices point at the reserved slot 0
    FILL = "fill"  # a declared constant (e.g. the backend's seq_len fill value)
    WIDTH = "width"  # the buffer's declared width (speculative lengths: W tokens)
    KEEP = "keep"  # never read on padded rows; left as it is


class Axis(enum.Enum):
    """What a buffer's rows count: requests (decode and the speculative
    phases: every buffer), or the step's tokens (a token batch's
    ``input_ids``, ``positions``, ``out_cache_loc``)."""

    REQUEST = "request"
    TOKEN = "token"


class StepSize(NamedTuple):
    """A token batch's size on its two axes: ``tokens`` (rows of the
    token-axis buffers) and ``requests`` (rows of the request-axis ones).
    A one-axis step's size is a plain int, its requests."""

    tokens: int
    requests: int

    def __str__(self) -> str:
        return f"{self.tokens} tokens x {self.requests} requests"


#: A step's size: an int (requests) for a one-axis step, a :class:`StepSize` for a token batch.
Size: TypeAlias = "int | StepSize"


def units(axis: Axis, size: int | StepSize) -> int:
    """How many units of ``axis`` a step of ``size`` holds."""
    if type(size) is int:
        return size
    assert isinstance(size, StepSize)
    return size.tokens if axis is Axis.TOKEN else size.requests


def has_rows(size: int | StepSize) -> bool:
    """Whether a step of ``size`` has any live row (capture's all-padding step has none)."""
    return size > 0 if isinstance(size, int) else any(size)


def fits(raw: int | StepSize, size: int | StepSize, top: int | StepSize) -> bool:
    """``0 <= raw <= size <= top`` on every axis (sizes of one kind)."""
    if type(size) is int:
        return type(raw) is int and type(top) is int and 0 <= raw <= size <= top
    if not (isinstance(raw, StepSize) and isinstance(size, StepSize) and isinstance(top, StepSize)):
        return False
    return all(0 <= r <= s <= t for r, s, t in zip(raw, size, top, strict=True))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_width(name: str, value: object) -> int:
    """``value`` as a width (tokens per request: an int >= 1), or a
    ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1")
    return value


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One static input: its name (the attribute read from the batch), dtype,
    pad rule and layout.

    Args:
        name: the attribute read from the batch and seen by the forward.
        dtype: the buffer's dtype; inputs must match it exactly.
        rule: what padded rows hold (:class:`PadRule`).
        rows_per_request: rows each request occupies: 1 (per request), ``W``
            (per token of a ``W``-token speculative step), ``k`` (top-k).
        extra_shape: trailing dims of every row (e.g. ``(hidden,)``).
        fill_value: the constant of :attr:`PadRule.FILL` (only with it).
        width: the value of :attr:`PadRule.WIDTH` (only with it), e.g. the
            number of draft tokens per request for extend or accept lengths.
        host: the buffer lives in host memory (a padded host mirror such as
            ``seq_lens_cpu`` for a backend that plans on the CPU).
        index: the buffer holds indices (pool rows, KV slots, positions, token
            ids): its padded rows must point at slot 0 or at the width, so
            only :attr:`PadRule.ZERO` and :attr:`PadRule.WIDTH` are accepted.
        future: live values below 0 are future references ``-r`` that
            populate resolves from the runner's
            :class:`~graphrunner.core.future_map.FutureMap` (row ``r``'s next token).
        backend_fill: the fill value is the attention backend's
            ``seq_len_fill_value`` (``seq_lens``): a runner refuses a backend
            whose value differs.
        indexes: what the live values index (:class:`Index`), which the
            padding sanitizer checks; None: nothing it checks.
            :attr:`Index.COUNT` needs :attr:`PadRule.WIDTH` (its top is the width).
        axis: what its rows count (:class:`Axis`): requests (the default) or,
            in a token batch, the step's tokens.

    Shape of the allocated buffer: ``[max_bs * rows_per_request, *extra_shape]``
    (a token-axis buffer: ``[max_tokens * rows_per_request, ...]``).
    """

    name: str
    dtype: torch.dtype
    rule: PadRule
    _: KW_ONLY
    rows_per_request: int = 1
    extra_shape: tuple[int, ...] = ()
    fill_value: int | float | None = None
    width: int | None = None
    host: bool = False
    index: bool = False
    future: bool = False
    backend_fill: bool = False
    indexes: Index | None = None
    axis: Axis = Axis.REQUEST

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"buffer name must be an identifier, got {self.name!r}")
        if not isinstance(self.rule, PadRule):
            raise ValueError(
                f"buffer {self.name!r} declared without a pad rule (got {self.rule!r}); "
                f"every static buffer needs one of {[r.name for r in PadRule]}"
            )
        if self.name in _VIEW_ATTRIBUTES:
            raise ValueError(
                f"buffer name {self.name!r} is taken by BufferView itself "
                f"({sorted(_VIEW_ATTRIBUTES)}); the model could not read it"
            )
        self._check_layout()
        if self.index and self.rule not in (PadRule.ZERO, PadRule.WIDTH):
            raise ValueError(
                f"buffer {self.name!r} holds indices and pads with {self.rule.name}; an index "
                f"buffer must pad to slot 0 (PadRule.ZERO) or to the width (PadRule.WIDTH)"
            )
        if self.indexes is not None and not isinstance(self.indexes, Index):
            raise ValueError(
                f"buffer {self.name!r}: indexes={self.indexes!r}; expected an Index or None"
            )
        if self.indexes is Index.COUNT and self.rule is not PadRule.WIDTH:
            raise ValueError(
                f"buffer {self.name!r} declares indexes=Index.COUNT with rule={self.rule.name}; "
                f"a count in 1..W needs PadRule.WIDTH (its width is W)"
            )
        self._check_rule_value("fill_value", self.fill_value, PadRule.FILL)
        self._check_rule_value("width", self.width, PadRule.WIDTH)
        if self.fill_value is not None:
            _check_exact(self.name, "fill_value", self.dtype, self.fill_value)
        if self.width is not None:
            if not _is_int(self.width) or self.width < 1:
                raise ValueError(
                    f"buffer {self.name!r}: width={self.width!r}; expected an int >= 1"
                )
            _check_exact(self.name, "width", self.dtype, self.width)

    def _check_layout(self) -> None:
        if not _is_int(self.rows_per_request) or self.rows_per_request < 1:
            raise ValueError(
                f"buffer {self.name!r}: rows_per_request={self.rows_per_request!r}; "
                f"expected an int >= 1"
            )
        if not isinstance(self.extra_shape, tuple) or not all(
            _is_int(d) and d >= 1 for d in self.extra_shape
        ):
            raise ValueError(
                f"buffer {self.name!r}: extra_shape={self.extra_shape!r}; "
                f"expected a tuple of ints >= 1"
            )
        if not isinstance(self.axis, Axis):
            raise ValueError(
                f"buffer {self.name!r}: axis={self.axis!r}; expected {[a for a in Axis]}"
            )
        for flag in ("host", "index", "future"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(
                    f"buffer {self.name!r}: {flag}={getattr(self, flag)!r}; expected a bool"
                )

    def _check_rule_value(self, field: str, value: object, rule: PadRule) -> None:
        if (self.rule is rule) != (value is not None):
            raise ValueError(
                f"buffer {self.name!r}: {field} is required with PadRule.{rule.name} and "
                f"only with it (rule={self.rule.name}, {field}={value!r})"
            )

    def pad_value(self) -> int | float | None:
        """The value of every padded element, or None for :attr:`PadRule.KEEP`."""
        if self.rule is PadRule.ZERO:
            return 0
        if self.rule is PadRule.WIDTH:
            return self.width
        return self.fill_value

    def rows(self, bs: int | StepSize) -> int:
        """Rows of this buffer that a step of ``bs`` requests (or of a
        :class:`StepSize`, read on this buffer's axis) occupies."""
        return units(self.axis, bs) * self.rows_per_request

    @property
    def takes_host_source(self) -> bool:
        """A device buffer of integer or bool dtype also takes its input as
        a CPU tensor: ids, positions, lengths and slots a scheduler builds on
        the host. Populate copies it in (the fused writers through their
        pinned staging buffer: one copy for every such field of a step).
        Float inputs (hidden states) are device-produced and must be on the
        buffer's device."""
        return not self.host and not (self.dtype.is_floating_point or self.dtype.is_complex)


_VIEW_ATTRIBUTES = frozenset({"bs", "tensors"})


def _check_exact(name: str, field: str, dtype: torch.dtype, value: int | float) -> None:
    """The buffer must hold exactly ``value``, or the sanitizer would flag
    populate's own (converted) write: ``value`` must survive a round trip
    through ``dtype`` (no truncation, wrap-around, rounding or overflow)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = (number and not math.isnan(value)) or (isinstance(value, bool) and dtype == torch.bool)
    if ok:
        try:
            ok = torch.tensor(value, dtype=dtype).item() == value
        except (RuntimeError, OverflowError):  # e.g. -1 into uint8
            ok = False
    if not ok:
        raise ValueError(
            f"buffer {name!r}: {field} {value!r} is not exactly representable as {dtype}"
        )


def place(spec: BufferSpec, device: torch.device) -> torch.device:
    """Where ``spec``'s buffer lives on a runner of ``device``: the host for ``host`` buffers."""
    return torch.device("cpu") if spec.host else device


def _check_future(specs: Sequence[BufferSpec], tokens: torch.Tensor | None) -> torch.Tensor | None:
    futures = [s.name for s in specs if s.future]
    if bool(futures) != (tokens is not None):
        raise ValueError(
            f"buffers declared future=True: {futures}; a future map was "
            f"{'not ' if tokens is None else ''}given (one goes with the other)"
        )
    for name in futures:
        spec = next(s for s in specs if s.name == name)
        if spec.dtype != torch.int64 or spec.host or spec.extra_shape:
            raise ValueError(
                f"buffer {name!r}: future references need a device int64 [rows] buffer"
            )
    return tokens


class BufferView:
    """What a forward reads: the step's declared buffers, as attributes by name.

    At capture and replay, the first ``bs`` requests' rows of every static
    buffer (``bs`` the captured size; rows past the live ones are padding); on
    the eager path, the live rows themselves. A buffer of ``r`` rows per
    request shows ``bs * r`` rows.
    """

    bs: int

    def __init__(self, bs: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.__dict__.update(tensors)
        self.bs = bs

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}

    if TYPE_CHECKING:  # the declared buffers, by name (set from the mapping)

        def __getattr__(self, name: str) -> torch.Tensor: ...


class StaticBuffers:
    """Every static input of a runner, allocated once at ``max_bs``.

    Args:
        specs: one :class:`BufferSpec` per input; names unique.
        max_bs: the largest captured batch size (a token batch: the most
            requests one step holds).
        device: where the buffers live (``host=True`` ones live on the CPU).
        future_tokens: the future map's tokens (int64 ``[rows]`` on ``device``),
            required exactly when a spec declares ``future=True``.
        max_tokens: the largest captured token count, required exactly when
            a spec lies on :attr:`Axis.TOKEN` (a token batch).

    Sizes: a one-axis step's size is an int, its requests. A token batch's
    is a :class:`StepSize`; an int ``n`` given for it is a captured token
    count, whose requests are ``min(n, max_bs)`` (:meth:`size_of`).
    """

    def __init__(
        self,
        specs: Sequence[BufferSpec],
        max_bs: int,
        device: torch.device | str,
        *,
        future_tokens: torch.Tensor | None = None,
        max_tokens: int | None = None,
    ) -> None:
        if not _is_int(max_bs) or max_bs < 1:
            raise ValueError(f"max_bs={max_bs!r}; expected an int >= 1")
        for s in specs:
            if not isinstance(s, BufferSpec):
                raise TypeError(f"expected BufferSpec, got {type(s).__name__}: {s!r}")
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"buffer names declared more than once: {dupes}")
        self.specs: tuple[BufferSpec, ...] = tuple(specs)
        self.max_bs = max_bs
        self.two_axes = _check_axes(self.specs, max_tokens)
        #: The largest size: ``max_bs``, or for a token batch ``StepSize(max_tokens, max_bs)``.
        self.max_size: int | StepSize = (
            StepSize(max_tokens, max_bs) if max_tokens is not None else max_bs
        )
        self.future_tokens = _check_future(self.specs, future_tokens)
        # Normalised (e.g. "cuda" -> "cuda:0") so input checks compare exactly.
        self.device = torch.empty(0, device=device).device
        # Read-only: populate's cached plans and the captured graphs hold these
        # exact tensors, so a buffer is never swapped for another. Buffers of
        # one layout are rows of one allocation (populate writes them at once).
        tensors, packs = allocate_packed(self.specs, self.max_size, self.device_of)
        self.packs: tuple[BufferPack, ...] = packs
        self.tensors: Mapping[str, torch.Tensor] = MappingProxyType(tensors)
        self._views: dict[int | StepSize, BufferView] = {}

    def device_of(self, spec: BufferSpec) -> torch.device:
        """Where ``spec``'s buffer lives: the host for ``host`` buffers."""
        return place(spec, self.device)

    def size_of(self, size: int | StepSize) -> int | StepSize:
        """``size`` as these buffers count it: an int for one axis; for a
        token batch, an int ``n`` (a captured token count) is
        ``StepSize(n, min(n, max_bs))``: every request owns a token, so a
        step of ``n`` tokens holds at most ``n`` requests."""
        if self.two_axes and type(size) is int:
            return StepSize(size, min(size, self.max_bs))
        return size

    def rows(self, spec: BufferSpec, bs: int | StepSize) -> int:
        """Rows of ``spec``'s buffer that a step of size ``bs`` occupies."""
        return spec.rows(self.size_of(bs))

    def view(self, bs: int | StepSize) -> BufferView:
        """The cached view of a step of size ``bs``'s rows (stable addresses);
        its ``bs`` attribute is the requests."""
        size = self.size_of(bs)
        if not fits(size, size, self.max_size) or units(Axis.REQUEST, size) < 1:
            raise ValueError(f"view size must be in [1, {self.max_size}], got {size}")
        view = self._views.get(size)
        if view is None:
            tensors = {s.name: self.tensors[s.name][: s.rows(size)] for s in self.specs}
            view = self._views[size] = BufferView(units(Axis.REQUEST, size), tensors)
        return view


def _check_axes(specs: Sequence[BufferSpec], max_tokens: int | None) -> bool:
    """Whether ``specs`` make a token batch (a buffer on :attr:`Axis.TOKEN`),
    ``max_tokens`` given exactly then."""
    token = [s.name for s in specs if s.axis is Axis.TOKEN]
    if bool(token) != (max_tokens is not None):
        raise ValueError(
            f"buffers on the token axis: {token}; max_tokens={max_tokens!r} "
            f"(a token batch needs its largest token count, and only it)"
        )
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise ValueError(f"max_tokens={max_tokens!r}; expected an int >= 1")
    return bool(token)
