"""KV token slots (host allocator) and the per-layer KV buffers they index."""

from __future__ import annotations

import collections

import torch

from graphrunner.pools.checks import (
    DeviceLike,
    SlotIndices,
    as_index_list,
    bad_arg,
    check_count,
    check_device,
    check_each,
    check_float_dtype,
    check_int,
    check_tensor,
)
from graphrunner.pools.errors import DoubleFree, InvalidSlot, PoolError, PoolExhausted
from graphrunner.pools.slots import SlotAllocator

__all__ = ["KVCache", "TokenToKVPoolAllocator", "starts_page", "whole_pages"]


def whole_pages(tokens: int, page_size: int) -> int:
    """KV slots that hold ``tokens`` tokens in whole pages of ``page_size``."""
    return -(-tokens // page_size) * page_size


def starts_page(seq_len: int, page_size: int) -> bool:
    """Whether a request of ``seq_len`` tokens puts its next one in a fresh page
    (else in the slot after its last token, inside a page it owns)."""
    return seq_len % page_size == 0


def _check_page_geometry(where: str, size: int, page_size: int) -> tuple[int, int]:
    page_size = check_count(f"{where}: page_size", page_size, minimum=1)
    size = check_count(f"{where}: size", size, minimum=page_size)
    if size % page_size:
        raise bad_arg(f"{where}: size", size, f"a multiple of page_size {page_size}", PoolError)
    return size, page_size


class TokenToKVPoolAllocator:
    """Hands out KV token slots ``1..size`` (page_size 1) or whole pages.

    With ``page_size > 1`` slot ``s`` lives in page ``s // page_size``; pages
    ``1..size // page_size`` are handed out whole (``alloc(n)`` needs ``n`` a
    multiple of ``page_size`` and returns the pages' slots in order), and page 0
    (slots ``0..page_size - 1``) is the reserved padding page. ``free`` takes
    token slots and only whole pages. Sizes are in tokens. Host-only; ``device``
    records where the matching :class:`KVCache` lives.
    """

    def __init__(self, size: int, device: DeviceLike, page_size: int = 1) -> None:
        where = "TokenToKVPoolAllocator"
        self.size, self.page_size = _check_page_geometry(where, size, page_size)
        self.device = check_device(f"{where}: device", device)
        # Errors speak the caller's unit: slots when a page is one slot.
        unit = "KV slot" if self.page_size == 1 else "KV page"
        self._pages = SlotAllocator(self.size // self.page_size, name=unit)

    @property
    def num_pages(self) -> int:
        return self.size // self.page_size

    def available_size(self) -> int:
        """Free token slots."""
        return self._pages.available_size() * self.page_size

    def is_allocated(self, slot: int) -> bool:
        """Whether token ``slot`` (any int; padding and out of range: False) is handed out."""
        n = check_int("is_allocated: slot", slot)
        return n >= self.page_size and self._pages.is_allocated(n // self.page_size)

    def allocated(self) -> frozenset[int]:
        """Allocated token slots."""
        ps = self.page_size
        return frozenset(p * ps + o for p in self._pages.allocated() for o in range(ps))

    def clear(self) -> None:
        self._pages.clear()

    def alloc(self, n: int) -> list[int]:
        """``n`` token slots (whole pages, lowest first); PoolExhausted if fewer are free."""
        n = check_count("alloc: n", n)
        if n % self.page_size:
            raise bad_arg("alloc: n", n, f"a multiple of page_size {self.page_size}", PoolError)
        if n > self.available_size():
            raise PoolExhausted(n, self.available_size(), "KV token slots")
        ps = self.page_size
        return [p * ps + o for p in self._pages.alloc(n // ps) for o in range(ps)]

    def free(self, slots: SlotIndices) -> None:
        """Free token slots (allocated, whole pages); all-or-nothing."""
        name = "free: slots"
        if self.page_size == 1:  # a page is a slot
            self._pages.free(slots, name)
        else:
            self._pages.free(self._whole_pages(as_index_list(slots, name), name), name)

    def _whole_pages(self, tokens: list[int], name: str) -> list[int]:
        """The pages ``tokens`` fill exactly, each slot in range, allocated, listed once."""
        ps = self.page_size
        pad = f"slots 0..{ps - 1} are the reserved padding page"
        what = f"a KV slot in {ps}..{self.size + ps - 1} ({pad})"
        check_each(name, tokens, ps, self.size + ps - 1, error=InvalidSlot, what=what)
        seen: set[int] = set()
        for i, slot in enumerate(tokens):
            if not self._pages.is_allocated(slot // ps):
                raise bad_arg(f"{name}[{i}]", slot, "a slot of an allocated page", DoubleFree)
            if slot in seen:
                raise bad_arg(f"{name}[{i}]", slot, "each KV slot listed once", DoubleFree)
            seen.add(slot)
        counts = collections.Counter(slot // ps for slot in tokens)
        for page, count in counts.items():
            if count != ps:
                first = page * ps
                expected = f"whole pages: page {page} (slots {first}..{first + ps - 1}) has {count}"
                raise bad_arg(name, tokens, expected, InvalidSlot)
        return list(counts)


class KVCache:
    """Per-layer K and V buffers indexed by KV token slot.

    Tensors (``dtype``, on ``device``, zero-initialised):
        k_buffers[layer], v_buffers[layer]: ``[size + page_size, num_kv_heads, head_dim]``.
            Slots ``0..page_size - 1`` are the padding page: zeros at first, then
            only the (finite) writes of padded rows; nothing live ever reads them.

    ``set_kv`` is graph-capturable and ``torch.compile``-friendly: it checks the
    arguments' types, dtypes, shapes and devices, never a value on the device (so
    the values of ``loc`` are trusted: a slot out of range is torch's error).
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: DeviceLike,
        page_size: int = 1,
    ) -> None:
        where = "KVCache"
        self.size, self.page_size = _check_page_geometry(where, size, page_size)
        self.num_layers = check_count(f"{where}: num_layers", num_layers, minimum=1)
        self.num_kv_heads = check_count(f"{where}: num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = check_count(f"{where}: head_dim", head_dim, minimum=1)
        self.dtype = check_float_dtype(f"{where}: dtype", dtype)
        self.device = check_device(f"{where}: device", device)
        shape = (self.size + self.page_size, self.num_kv_heads, self.head_dim)
        self.k_buffers = [self._zeros(shape) for _ in range(self.num_layers)]
        self.v_buffers = [self._zeros(shape) for _ in range(self.num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, num_kv_heads, head_dim]`` at slots ``loc`` (int64 ``[n]``).

        Padded rows carry slot 0; several may hit it in one call, which is fine:
        slot 0 is a sink nobody reads meaningfully. ``k``/``v`` of another floating
        dtype are cast. Everything is checked before either buffer is written.
        """
        layer = self._check_layer("set_kv: layer", layer)
        check_tensor("set_kv: loc", loc, dtype=torch.int64, shape=(None,), devices=(self.device,))
        shape = (loc.shape[0], self.num_kv_heads, self.head_dim)
        for name, t in (("set_kv: k", k), ("set_kv: v", v)):
            check_tensor(name, t, dtype="floating", shape=shape, devices=(self.device,))
        self.k_buffers[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer].index_copy_(0, loc, v.to(self.dtype))

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full ``(k, v)`` buffers of ``layer``, ``[size + page_size, H, D]`` each."""
        layer = self._check_layer("get_kv: layer", layer)
        return self.k_buffers[layer], self.v_buffers[layer]

    def _check_layer(self, name: str, layer: int) -> int:
        return check_count(name, layer, 0, self.num_layers - 1)
