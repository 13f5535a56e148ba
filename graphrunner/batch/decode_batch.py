"""The decode batch: device tensors plus the host mirrors that keep every step sync-free."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphrunner.declare.decode import DECODE_FIELD_NAMES, DECODE_HOST_MIRRORS
from graphrunner.pools.errors import PoolExhausted
from graphrunner.pools.kv import TokenToKVPoolAllocator, starts_page
from graphrunner.pools.req_to_token import ReqToTokenPool
from graphrunner.pools.slots import (
    DeviceLike,
    as_index_list,
    bad_arg,
    check_count,
    check_device,
    check_each,
    check_tensor,
    same_device,
)

__all__ = ["BatchError", "DecodeBatch"]


class BatchError(ValueError):
    """A wrong argument value (a wrong type is a ``TypeError``); the batch (and any
    pool) is left exactly as it was."""


#: Attributes whose assignment from outside breaks a batch's seal.
_SEALED_FIELDS = frozenset((*DECODE_FIELD_NAMES, *DECODE_HOST_MIRRORS.values()))


def _host(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


#: torch's ``Tensor._version`` descriptor, looked up once (the private name stays torch's).
_VERSION = vars(torch._C.TensorBase)["_version"]


def _version_of(tensor: torch.Tensor) -> int:
    """The tensor's version counter, bumped by every in-place change."""
    return int(_VERSION.__get__(tensor))


def host_min_max(values: torch.Tensor) -> tuple[int, int] | None:
    """``(min, max)`` of a host int tensor (no device sync), None when empty."""
    if not values.numel():
        return None
    low, high = values.aminmax()
    return int(low), int(high)


def _ranges(reqs: list[int], lens: list[int]) -> dict[str, tuple[int, int]]:
    """The mirrors' (min, max) from the host ints they were made from (none when empty)."""
    if not reqs:
        return {}
    return {
        DECODE_HOST_MIRRORS["req_pool_indices"]: (min(reqs), max(reqs)),
        DECODE_HOST_MIRRORS["seq_lens"]: (min(lens), max(lens)),
    }


def _host_ints(name: str, values: object, what: str = "ints") -> list[int]:
    """Python or NumPy ints from a sequence or a 1-D integer CPU tensor, as the pools take."""
    expected = f"a sequence of {what} (host ints or a 1-D integer CPU tensor)"
    return as_index_list(values, name, expected=expected, error=BatchError)


def _geometry(where: str, device: object, max_context_len: object) -> tuple[torch.device, int]:
    return (
        _indexed(check_device(f"{where}: device", device, BatchError)),
        check_count(f"{where}: max_context_len", max_context_len, 1, error=BatchError),
    )


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the CUDA device it means now (``cuda:0``), as a tensor made
    there reports it: a runner compares a sealed batch's device exactly."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


class DecodeBatch:
    """``bs`` live requests decoding one token each; satisfies :class:`DecodeInputs`.

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
        "_sealed",
        "_host_ranges",
        *DECODE_FIELD_NAMES,
        *DECODE_HOST_MIRRORS.values(),
    )
    _sealed: bool
    _host_ranges: dict[str, tuple[torch.Tensor, int, int, int]]

    def __setattr__(self, name: str, value: object) -> None:
        # A field assigned from outside breaks the seal (see is_sealed); the
        # batch's own operations re-seal once they have assigned everything.
        object.__setattr__(self, name, value)
        if name in _SEALED_FIELDS:
            object.__setattr__(self, "_sealed", False)

    def is_sealed(self) -> bool:
        """True while every field and mirror is the tensor this batch's own
        last operation made and validated (no field assigned from outside
        since): a runner then skips its per-field input checks."""
        return self._sealed

    def _seal(self, ranges: dict[str, tuple[int, int]] | None = None) -> None:
        """Seal the fields as this operation made them; ``ranges`` gives the
        host mirrors' (min, max) where the operation knew them from its host ints."""
        known: dict[str, tuple[torch.Tensor, int, int, int]] = {}
        for name, (low, high) in (ranges or {}).items():
            mirror = getattr(self, name)
            known[name] = (mirror, _version_of(mirror), low, high)
        object.__setattr__(self, "_host_ranges", known)
        object.__setattr__(self, "_sealed", True)

    def host_range(self, name: str) -> tuple[int, int] | None:
        """``(min, max)`` of host mirror ``name`` (``seq_lens_cpu`` or
        ``req_pool_indices_cpu``), None when it is empty. Computed once per
        mirror tensor and kept while that tensor is the mirror and unchanged
        in place (its version counter), so a runner's per-step range checks
        cost a lookup; known without computing after :meth:`prepare_decode`
        and :meth:`from_requests`, which hold the host ints already."""
        mirror = getattr(self, name)
        entry = self._host_ranges.get(name)
        if entry is not None and entry[0] is mirror and entry[1] == _version_of(mirror):
            return entry[2], entry[3]
        bounds = host_min_max(mirror)
        if bounds is not None:
            self._host_ranges[name] = (mirror, _version_of(mirror), *bounds)
        return bounds

    def __init__(self, device: DeviceLike, max_context_len: int) -> None:
        """An empty (idle) batch; see :meth:`empty`."""
        self.device, self.max_context_len = _geometry("DecodeBatch", device, max_context_len)
        self.req_pool_indices_cpu = _host([])
        self.seq_lens_cpu = _host([])
        self.req_pool_indices = self._to_device(self.req_pool_indices_cpu)
        self.seq_lens = self._to_device(self.seq_lens_cpu)
        self.input_ids = self._zeros(0)
        self.out_cache_loc = self._zeros(0)
        self.positions = self._zeros(0)
        self._seal()

    @classmethod
    def empty(cls, device: DeviceLike, max_context_len: int) -> DecodeBatch:
        """The idle batch: ``bs == 0``, every tensor ``[0]``."""
        return cls(*_geometry("empty", device, max_context_len))

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
        batch = cls(*_geometry("from_requests", device, max_context_len))
        reqs = _host_ints("from_requests: req_pool_indices", req_pool_indices)
        lens = _host_ints("from_requests: seq_lens", seq_lens)
        if len(reqs) != len(lens):
            raise BatchError(
                f"from_requests: {len(reqs)} req_pool_indices but {len(lens)} seq_lens; "
                "expected equal lengths"
            )
        batch._check_requests(reqs, lens)
        batch._check_input_ids("from_requests: input_ids", input_ids, len(reqs))
        batch.req_pool_indices_cpu = _host(reqs)
        batch.seq_lens_cpu = _host(lens)
        batch.req_pool_indices = batch._to_device(batch.req_pool_indices_cpu)
        batch.seq_lens = batch._to_device(batch.seq_lens_cpu)
        batch.input_ids = input_ids
        batch.out_cache_loc = batch._zeros(len(reqs))
        batch.positions = batch._zeros(len(reqs))
        batch._seal(_ranges(reqs, lens))
        return batch

    @property
    def batch_size(self) -> int:
        """Live requests (from the host mirror, never a sync)."""
        return int(self.req_pool_indices_cpu.shape[0])

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
        self._check_prepare(req_pool, kv_alloc, reqs, lens)
        if input_ids is not None:
            self._check_input_ids("prepare_decode: input_ids", input_ids, len(reqs))
        page = kv_alloc.page_size
        starting = [i for i, n in enumerate(lens) if starts_page(n, page)]
        need = len(starting) * page
        if need > kv_alloc.available_size():
            where = "prepare_decode: kv_alloc, slots needed"
            raise PoolExhausted(need, kv_alloc.available_size(), "KV token slots", where)
        fresh = kv_alloc.alloc(need)
        try:
            out_cache_loc = self._next_slots(req_pool, starting, fresh[::page])
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
        self._seal(_ranges(reqs, [n + 1 for n in lens]))
        return dict(zip(starting, fresh[::page], strict=True))

    def _next_slots(
        self, req_pool: ReqToTokenPool, starting: list[int], first_slots: list[int]
    ) -> torch.Tensor:
        """int64 ``[bs]`` on the device: ``first_slots`` for the ``starting`` rows,
        the slot after the last token for the others."""
        bs = self.batch_size
        if len(starting) == bs:  # page size 1, or every row at a page boundary
            return self._to_device(_host(first_slots))
        last = (self.seq_lens - 1).clamp_(min=0)
        after_last = req_pool.req_to_token[self.req_pool_indices, last].to(torch.int64) + 1
        is_starting = torch.zeros(bs, dtype=torch.bool)
        is_starting[starting] = True
        fresh = torch.zeros(bs, dtype=torch.int64)
        fresh[starting] = _host(first_slots)
        return torch.where(self._to_device(is_starting), self._to_device(fresh), after_last)

    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows ``keep`` (host ints, unique, ``0..bs-1``), in that order."""
        rows = _host_ints("filter: keep", keep, "row indices")
        bs = self.batch_size
        what = f"a row index in 0..{bs - 1}" if bs else "no row (the batch is empty)"
        check_each("filter: keep", rows, 0, bs - 1, error=BatchError, what=what)
        if len(set(rows)) != len(rows):
            raise bad_arg("filter: keep", keep, "each row at most once", BatchError)
        host_rows = _host(rows)
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

    def _check_requests(self, reqs: list[int], lens: list[int]) -> None:
        row = "a pool row >= 1 (0 is padding)"
        check_each("from_requests: req_pool_indices", reqs, 1, error=BatchError, what=row)
        check_each("from_requests: seq_lens", lens, 0, self.max_context_len, error=BatchError)
        if len(set(reqs)) != len(reqs):
            raise bad_arg("from_requests: req_pool_indices", reqs, "each pool row once", BatchError)

    def _check_input_ids(self, name: str, input_ids: object, bs: int) -> None:
        devices = (self.device,)
        check_tensor(
            name, input_ids, dtype=torch.int64, shape=(bs,), devices=devices, error=BatchError
        )

    def _check_prepare(
        self,
        req_pool: ReqToTokenPool,
        kv_alloc: TokenToKVPoolAllocator,
        reqs: list[int],
        lens: list[int],
    ) -> None:
        if not isinstance(req_pool, ReqToTokenPool):
            raise bad_arg("prepare_decode: req_pool", req_pool, "a ReqToTokenPool")
        if not isinstance(kv_alloc, TokenToKVPoolAllocator):
            raise bad_arg("prepare_decode: kv_alloc", kv_alloc, "a TokenToKVPoolAllocator")
        if not same_device(req_pool.device, self.device):
            raise BatchError(
                f"prepare_decode: req_pool is on {req_pool.device}; expected {self.device}"
            )
        if req_pool.max_context_len < self.max_context_len:
            raise BatchError(
                f"prepare_decode: req_pool.max_context_len {req_pool.max_context_len} is below "
                f"the batch's {self.max_context_len}; expected at least that"
            )
        for i, (req, n) in enumerate(zip(reqs, lens, strict=True)):
            if n + 1 > self.max_context_len:
                raise BatchError(
                    f"prepare_decode: row {i} (request {req}): seq_len {n} + 1 exceeds "
                    f"max_context_len {self.max_context_len}; expected room for one more token"
                )
            if not req_pool.is_allocated(req):
                raise BatchError(
                    f"prepare_decode: row {i}: request {req} is not allocated in req_pool; "
                    "expected live rows"
                )
