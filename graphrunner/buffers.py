"""Static buffers, each declared once with the rule for its padded rows.

A graph is captured over fixed addresses, so every input lives in a buffer
allocated once at the largest captured size. What the padded tail of each
buffer holds is data here (a :class:`PadRule`), applied by
:func:`graphrunner.populate.populate` and nowhere else.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = [
    "BufferSpec",
    "BufferView",
    "PadRule",
    "StaticBuffers",
    "decode_buffer_specs",
]


class PadRule(enum.Enum):
    """What a buffer holds on padded rows ``[raw_bs:bs]``."""

    ZERO = "zero"  # indices point at the reserved slot 0
    FILL = "fill"  # a declared constant (e.g. the backend's seq_len fill value)
    WIDTH = "width"  # the captured width: tokens per row (speculative lengths)
    KEEP = "keep"  # never read on padded rows; left as it is


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One static input: its name (the attribute read from the batch), dtype,
    layout and pad rule.

    Shape of the allocated buffer: ``[max_bs * tokens_per_row, *extra_shape]``
    when ``per_token``, else ``[max_bs, *extra_shape]``.
    """

    name: str
    dtype: torch.dtype
    rule: PadRule
    per_token: bool = False
    extra_shape: tuple[int, ...] = ()
    fill_value: int | float | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"buffer name must be an identifier, got {self.name!r}")
        if not isinstance(self.rule, PadRule):
            raise ValueError(
                f"buffer {self.name!r} declared without a pad rule (got {self.rule!r}); "
                f"every static buffer needs one of {[r.name for r in PadRule]}"
            )
        if (self.rule is PadRule.FILL) != (self.fill_value is not None):
            raise ValueError(
                f"buffer {self.name!r}: fill_value is required with PadRule.FILL and only "
                f"with it (rule={self.rule.name}, fill_value={self.fill_value!r})"
            )
        if self.name in _VIEW_ATTRIBUTES:
            raise ValueError(
                f"buffer name {self.name!r} is taken by BufferView itself "
                f"({sorted(_VIEW_ATTRIBUTES)}); the model could not read it"
            )
        if any(d < 1 for d in self.extra_shape):
            raise ValueError(f"buffer {self.name!r}: bad extra_shape {self.extra_shape}")
        if self.fill_value is not None:
            _check_fill_value(self.name, self.dtype, self.fill_value)

    def pad_value(self, width: int) -> int | float | None:
        """The value of every padded element, or None for :attr:`PadRule.KEEP`."""
        if self.rule is PadRule.ZERO:
            return 0
        if self.rule is PadRule.WIDTH:
            return width
        return self.fill_value


_VIEW_ATTRIBUTES = frozenset({"bs", "tensors"})


def _check_fill_value(name: str, dtype: torch.dtype, value: int | float) -> None:
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
            f"buffer {name!r}: fill_value {value!r} is not exactly representable as {dtype}"
        )


def decode_buffer_specs(*, seq_len_fill_value: int = 1) -> list[BufferSpec]:
    """The decode step's buffers with the pad rules of the design table.

    ``seq_len_fill_value`` is the attention backend's: padded rows read that
    many tokens through ``req_to_token`` row 0, i.e. the zeroed KV slot 0.
    """
    i64 = torch.int64
    return [
        BufferSpec("input_ids", i64, PadRule.ZERO),
        BufferSpec("req_pool_indices", i64, PadRule.ZERO),
        BufferSpec("seq_lens", i64, PadRule.FILL, fill_value=seq_len_fill_value),
        BufferSpec("out_cache_loc", i64, PadRule.ZERO),
        BufferSpec("positions", i64, PadRule.ZERO),
    ]


class BufferView:
    """The first ``bs`` rows of every static buffer, as attributes by name.

    This is what the model's forward receives during capture and replay.
    ``bs`` is the captured size; rows past the live ones are padding.
    """

    bs: int

    def __init__(self, bs: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.__dict__.update(tensors)
        self.bs = bs

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)}


class StaticBuffers:
    """Every static input of a runner, allocated once at ``max_bs``.

    Args:
        specs: one :class:`BufferSpec` per input; names unique.
        max_bs: the largest captured batch size.
        device: where the buffers live.
        tokens_per_row: tokens each request contributes to per-token buffers
            (1 for decode; the draft width for speculative runners).
    """

    def __init__(
        self,
        specs: Sequence[BufferSpec],
        max_bs: int,
        device: torch.device | str,
        *,
        tokens_per_row: int = 1,
    ) -> None:
        if max_bs < 1 or tokens_per_row < 1:
            raise ValueError(
                f"max_bs and tokens_per_row must be >= 1, got {max_bs}, {tokens_per_row}"
            )
        for s in specs:
            if not isinstance(s, BufferSpec):
                raise TypeError(f"expected BufferSpec, got {type(s).__name__}: {s!r}")
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"buffer names declared more than once: {dupes}")
        self.specs: tuple[BufferSpec, ...] = tuple(specs)
        self.max_bs = max_bs
        self.tokens_per_row = tokens_per_row
        # Read-only: populate's cached plans and the captured graphs hold these
        # exact tensors, so a buffer is never swapped for another.
        self.tensors: Mapping[str, torch.Tensor] = MappingProxyType(
            {
                s.name: torch.zeros(
                    (self.rows(s, max_bs), *s.extra_shape), dtype=s.dtype, device=device
                )
                for s in self.specs
            }
        )
        # Normalised (e.g. "cuda" -> "cuda:0") so input checks compare exactly.
        self.device = (
            next(iter(self.tensors.values())).device if self.tensors else torch.device(device)
        )
        self._views: dict[int, BufferView] = {}

    def rows(self, spec: BufferSpec, bs: int) -> int:
        """Rows of ``spec``'s buffer that ``bs`` requests occupy."""
        return bs * self.tokens_per_row if spec.per_token else bs

    def view(self, bs: int) -> BufferView:
        """The cached view of the first ``bs`` requests' rows (stable addresses)."""
        if not 1 <= bs <= self.max_bs:
            raise ValueError(f"view size must be in [1, {self.max_bs}], got {bs}")
        if bs not in self._views:
            self._views[bs] = BufferView(
                bs, {s.name: self.tensors[s.name][: self.rows(s, bs)] for s in self.specs}
            )
        return self._views[bs]
