"""The decode batch: device tensors plus the host mirrors that keep every step sync-free."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch

from graphrunner.batch.checks import check_input_ids, check_prepare, check_requests
from graphrunner.batch.host import (
    BatchError,
    geometry,
    host_ints,
    host_min_max,
    host_tensor,
    mirror_ranges,
)
from graphrunner.batch.paging import next_slots
from graphrunner.declare.buffers import BufferSpec, PadRule
from graphrunner.declare.decode import (
    DECODE_FIELD_NAMES,
    DECODE_FIELDS,
    DECODE_HOST_MIRRORS,
    INPUT_IDS,
    REQ_POOL_INDICES,
    SEQ_LENS,
)
from graphrunner.declare.sealed import HostRanges, SealKey, cached_range, known_ranges, seal_key
from graphrunner.pools.checks import DeviceLike, bad_arg, check_each, same_device
from graphrunner.pools.errors import PoolExhausted
from graphrunner.pools.kv import TokenToKVPoolAllocator, starts_page
from graphrunner.pools.req_to_token import ReqToTokenPool

__all__ = ["BatchError", "DecodeBatch", "host_min_max"]

#: Attributes whose assignment from outside breaks a batch's seal.
_SEALED_FIELDS = frozenset((*DECODE_FIELD_NAMES, *DECODE_HOST_MIRRORS.values()))
#: The mirror whose length is the batch size.
_ROWS_MIRROR = DECODE_HOST_MIRRORS[REQ_POOL_INDICES]
#: What a batch's own operations check: the decode fields on its device, and
#: the mirrors as host buffers (CPU int64 ``[bs]``, as a phase may declare them).
_MADE = (
    *DECODE_FIELDS,
    *(BufferSpec(m, torch.int64, PadRule.ZERO, host=True) for m in DECODE_HOST_MIRRORS.values()),
)


class DecodeBatch:
    """``bs`` live requests decoding one token each: the decode scheduler's
    step value, sealed by its own operations (what a replay takes, with
    :class:`~graphrunner.phases.SpecBatch` for any other phase).

    Device tensors (int64 ``[bs]`` on ``device``):
        input_ids: the token each request feeds this step.
        req_pool_indices: each request's row in ``req_to_token`` (never 0).
        seq_lens: tokens in the KV cache per request; after :meth:`prepare_decode`
            this includes the new token.
        out_cache_loc: the KV slot of the new token (never 0 once prepared).
        positions: the new token's position, ``seq_lens - 1`` once prepared.
    Host mirrors (CPU int64 ``[bs]``), always equal to their device twins:
        req_pool_indices_cpu, seq_lens_cpu.

    NOTE: a batch made by :meth:`from_requests` holds zeros in ``out_cache_loc``
    and ``positions`` (placeholders meaning "not prepared yet") and its
    ``seq_lens`` do not yet count the new token; call :meth:`prepare_decode`
    before running a step with it.

    No method reads a device tensor back: host facts come from the mirrors,
    device tensors are built from host tensors (``non_blocking``) or from other
    device tensors. Every failing call leaves the batch (and pools) unchanged.
    """

    # The decode phase's declared fields and mirrors (graphrunner.declare.decode).
    __slots__ = (
        "device",
        "max_context_len",
        "sealed",
        "seal_key",
        "batch_size",
        "host_ranges",
        *DECODE_FIELD_NAMES,
        *DECODE_HOST_MIRRORS.values(),
    )
    #: True while every field is the tensor this batch's own last operation
    #: made and validated (see :meth:`is_sealed`); a plain attribute, read by
    #: a runner's input gate without a call.
    sealed: bool
    #: What the seal vouches for: the decode fields on ``device`` and the host
    #: mirrors (:mod:`graphrunner.declare.sealed`).
    seal_key: SealKey
    #: Live requests: the host mirror's length, kept with it (never a sync).
    batch_size: int
    #: What the batch knows of its host mirrors' ranges (see HostRanges).
    host_ranges: HostRanges
    # A static mirror of the declared fields and mirrors, for type checkers
    # (the runtime slots and every assignment come from graphrunner.declare.decode;
    # tests/test_structure.py keeps the two equal).
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    req_pool_indices_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor

    def __setattr__(self, name: str, value: object) -> None:
        # A field assigned from outside breaks the seal (see is_sealed); the
        # batch's own operations re-seal once they have assigned everything.
        object.__setattr__(self, name, value)
        if name in _SEALED_FIELDS:
            object.__setattr__(self, "sealed", False)
        if name == _ROWS_MIRROR and isinstance(value, torch.Tensor):
            object.__setattr__(self, "batch_size", int(value.shape[0]))

    def is_sealed(self) -> bool:
        """True while every field and mirror is the tensor this batch's own
        last operation made and validated (no field assigned from outside
        since): a runner then skips its per-field input checks."""
        return self.sealed

    def _seal(self, ranges: dict[str, tuple[int, int]] | None = None) -> None:
        """Seal the fields as this operation made them; ``ranges`` gives the
        host mirrors' (min, max) where the operation knew them from its host ints."""
        object.__setattr__(self, "host_ranges", known_ranges(self, ranges or {}))
        object.__setattr__(self, "seal_key", _made_key(self.device))
        object.__setattr__(self, "sealed", True)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The declared decode fields and the host mirrors, by name."""
        return {n: getattr(self, n) for n in _SEALED_FIELDS}

    def host_range(self, name: str) -> tuple[int, int] | None:
        """``(min, max)`` of host mirror ``name`` (``seq_lens_cpu`` or
        ``req_pool_indices_cpu``), None when it is empty. Computed once per
        mirror tensor and kept while that tensor is the mirror and unchanged
        in place (its version counter), so a runner's per-step range checks
        cost a lookup; known without computing after :meth:`prepare_decode`
        and :meth:`from_requests`, which hold the host ints already."""
        return cached_range(self.host_ranges, name, getattr(self, name))

    def __init__(self, device: DeviceLike, max_context_len: int) -> None:
        """An empty (idle) batch; see :meth:`empty`."""
        self.device, self.max_context_len = geometry("DecodeBatch", device, max_context_len)
        self._fill({m: host_tensor([]) for m in DECODE_HOST_MIRRORS.values()}, {})
        self._seal()

    def _fill(self, mirrors: dict[str, torch.Tensor], given: dict[str, torch.Tensor]) -> None:
        """Every declared field of ``bs`` rows: a field with a host mirror is
        the device copy of ``mirrors[its mirror]`` (CPU int64 ``[bs]``), any
        other the ``given`` tensor, or zeros (placeholders, "not prepared yet")."""
        bs = int(next(iter(mirrors.values())).shape[0])
        for name in DECODE_FIELD_NAMES:
            mirror = DECODE_HOST_MIRRORS.get(name)
            if mirror is not None:
                setattr(self, mirror, mirrors[mirror])
                setattr(self, name, self._to_device(mirrors[mirror]))
            else:
                setattr(self, name, given[name] if name in given else self._zeros(bs))

    @classmethod
    def empty(cls, device: DeviceLike, max_context_len: int) -> DecodeBatch:
        """The idle batch: ``bs == 0``, every tensor ``[0]``."""
        return cls(*geometry("empty", device, max_context_len))

    @classmethod
    def from_requests(
        cls,
        req_pool_indices: Sequence[int],
        seq_lens: Sequence[int],
        input_ids: torch.Tensor,
        *,
        device: DeviceLike,
        max_context_len: int,
    ) -> DecodeBatch:
        """A batch of already-prefilled requests.

        Args:
            req_pool_indices: host ints, each request's (allocated, non-zero) pool row.
            seq_lens: host ints, tokens already in the cache per request,
                ``0..max_context_len``.
            input_ids: int64 ``[bs]`` on ``device``: the next token each request feeds.

        Host ints are Python or NumPy ints, in a sequence or a 1-D integer CPU
        tensor, as the pools take them.
        """
        batch = cls(*geometry("from_requests", device, max_context_len))
        reqs = host_ints("from_requests: req_pool_indices", req_pool_indices)
        lens = host_ints("from_requests: seq_lens", seq_lens)
        if len(reqs) != len(lens):
            raise BatchError(
                f"from_requests: {len(reqs)} req_pool_indices but {len(lens)} seq_lens; "
                "expected equal lengths"
            )
        check_requests(reqs, lens, batch.max_context_len)
        check_input_ids("from_requests: input_ids", input_ids, len(reqs), batch.device)
        host = {REQ_POOL_INDICES: host_tensor(reqs), SEQ_LENS: host_tensor(lens)}
        batch._fill({DECODE_HOST_MIRRORS[n]: t for n, t in host.items()}, {INPUT_IDS: input_ids})
        batch._seal(mirror_ranges(reqs, lens))
        return batch

    def is_empty(self) -> bool:
        return self.batch_size == 0

    def __repr__(self) -> str:
        return (
            f"DecodeBatch(bs={self.batch_size}, device={self.device}, "
            f"req_pool_indices={self.req_pool_indices_cpu.tolist()}, "
            f"seq_lens={self.seq_lens_cpu.tolist()})"
        )

    def prepare_decode(
        self,
        req_pool: ReqToTokenPool,
        kv_alloc: TokenToKVPoolAllocator,
        input_ids: torch.Tensor | None = None,
    ) -> dict[int, int]:
        """Advance every request by one token; returns the fresh pages it
        allocated, as ``{row: first slot}`` for the rows that started one (host
        ints, no read back: what to free if the step never runs).

        Per row: take the next KV slot, ``positions = seq_lens`` (old),
        ``req_to_token[req, position] = slot`` (one vectorised device write),
        ``seq_lens += 1``, ``out_cache_loc = slot``. ``input_ids`` (int64 ``[bs]``
        on ``device``, e.g. last step's sampled tokens) replaces the batch's if
        given. Everything is validated before any KV is allocated.

        The next slot: with ``kv_alloc.page_size == 1``, a fresh one per row. With
        pages of ``P`` slots, a row whose length is a multiple of ``P`` starts a
        fresh page (the host knows which rows, from ``seq_lens_cpu``); any other
        row takes the slot after its last token, gathered from ``req_to_token``
        on the device, never read back. So a request's tokens must sit in its
        pages in order, as a paged prefill writes them.
        """
        reqs = self.req_pool_indices_cpu.tolist()
        lens = self.seq_lens_cpu.tolist()
        check_prepare(req_pool, kv_alloc, reqs, lens, self.device, self.max_context_len)
        if input_ids is not None:
            check_input_ids("prepare_decode: input_ids", input_ids, len(reqs), self.device)
        page = kv_alloc.page_size
        starting = [i for i, n in enumerate(lens) if starts_page(n, page)]
        need = len(starting) * page
        if need > kv_alloc.available_size():
            where = "prepare_decode: kv_alloc, slots needed"
            raise PoolExhausted(need, kv_alloc.available_size(), "KV token slots", where)
        fresh = kv_alloc.alloc(need)
        try:
            out_cache_loc = next_slots(
                req_pool, self.req_pool_indices, self.seq_lens, starting, fresh[::page]
            )
            req_pool.write_tokens(reqs, lens, out_cache_loc)
        except BaseException:
            kv_alloc.free(fresh)
            raise
        self.positions = self.seq_lens
        self.seq_lens = self.seq_lens + 1
        self.seq_lens_cpu = self.seq_lens_cpu + 1
        self.out_cache_loc = out_cache_loc
        if input_ids is not None:
            self.input_ids = input_ids
        self._seal(mirror_ranges(reqs, [n + 1 for n in lens]))
        return dict(zip(starting, fresh[::page], strict=True))

    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (host ints, unique, ``0..bs-1``), in that order."""
        rows = host_ints("filter: keep", keep, "row indices")
        bs = self.batch_size
        what = f"a row index in 0..{bs - 1}" if bs else "no row (the batch is empty)"
        check_each("filter: keep", rows, 0, bs - 1, error=BatchError, what=what)
        if len(set(rows)) != len(rows):
            raise bad_arg("filter: keep", keep, "each row at most once", BatchError)
        host_rows = host_tensor(rows)
        dev_rows = self._to_device(host_rows)
        self._assign(
            {n: getattr(self, n).index_select(0, dev_rows) for n in DECODE_FIELD_NAMES},
            {n: getattr(self, n).index_select(0, host_rows) for n in DECODE_HOST_MIRRORS.values()},
        )

    def merge(self, other: DecodeBatch) -> None:
        """Append ``other``'s rows (``other`` is left as it was; it may be empty)."""
        if not isinstance(other, DecodeBatch):
            raise bad_arg("merge: other", other, "a DecodeBatch")
        if not same_device(self.device, other.device):
            raise BatchError(f"merge: other is on {other.device}; expected {self.device}")
        if other.max_context_len != self.max_context_len:
            raise BatchError(
                f"merge: other has max_context_len {other.max_context_len}; expected "
                f"{self.max_context_len}, this batch's"
            )
        shared = set(self.req_pool_indices_cpu.tolist()) & set(other.req_pool_indices_cpu.tolist())
        if shared:
            raise BatchError(
                f"merge: other holds pool rows {sorted(shared)}; expected rows this batch "
                "does not hold"
            )

        def cat(names: Sequence[str]) -> dict[str, torch.Tensor]:
            return {n: torch.cat([getattr(self, n), getattr(other, n)]) for n in names}

        self._assign(cat(DECODE_FIELD_NAMES), cat(list(DECODE_HOST_MIRRORS.values())))

    def _assign(self, device: dict[str, torch.Tensor], host: dict[str, torch.Tensor]) -> None:
        # Computed in full before any is assigned: a failing op leaves the batch as it was.
        for name, tensor in (*device.items(), *host.items()):
            setattr(self, name, tensor)
        self._seal()

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # copy=True: on a CPU batch the device tensor must not alias its host mirror.
        return host.to(self.device, non_blocking=True, copy=True)

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int64, device=self.device)


@cache
def _made_key(device: torch.device) -> SealKey:
    return seal_key(_MADE, device)
