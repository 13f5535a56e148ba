"""KV token slots (host allocator) and the per-layer KV buffers they index."""

from __future__ import annotations

import torch

from graphrunner.pools.errors import DoubleFree, InvalidSlot, PoolExhausted
from graphrunner.pools.slots import (
    DeviceLike,
    SlotAllocator,
    SlotIndices,
    as_index_list,
    check_count,
)

__all__ = ["KVCache", "TokenToKVPoolAllocator", "starts_page", "whole_pages"]


def whole_pages(tokens: int, page_size: int) -> int:
    """KV slots that hold ``tokens`` tokens in whole pages of ``page_size``."""
    return -(-tokens // page_size) * page_size


def starts_page(seq_len: int, page_size: int) -> bool:
    """Whether a request of ``seq_len`` tokens puts its next one in a fresh page
    (else in the slot after its last token, inside a page it owns)."""
    return seq_len % page_size == 0


def _check_page_geometry(size: int, page_size: int) -> tuple[int, int]:
    page_size = check_count("page_size", page_size, minimum=1)
    size = check_count("size", size, minimum=page_size)
    if size % page_size:
        raise ValueError(f"size {size} is not a multiple of page_size {page_size}")
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
        self.size, self.page_size = _check_page_geometry(size, page_size)
        self.device = torch.device(device)
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
        return slot >= self.page_size and self._pages.is_allocated(slot // self.page_size)

    def allocated(self) -> frozenset[int]:
        """Allocated token slots."""
        ps = self.page_size
        return frozenset(p * ps + o for p in self._pages.allocated() for o in range(ps))

    def clear(self) -> None:
        self._pages.clear()

    def alloc(self, n: int) -> list[int]:
        """``n`` token slots (whole pages, lowest first); PoolExhausted if fewer are free."""
        n = check_count("n", n)
        if n % self.page_size:
            raise ValueError(f"n={n} is not a multiple of page_size {self.page_size}")
        if n > self.available_size():
            raise PoolExhausted(n, self.available_size(), "KV token slots")
        ps = self.page_size
        return [p * ps + o for p in self._pages.alloc(n // ps) for o in range(ps)]

    def free(self, slots: SlotIndices) -> None:
        """Free token slots (whole pages); all-or-nothing."""
        tokens = as_index_list(slots, "KV slot")
        if self.page_size == 1:
            self._pages.free(tokens)
            return
        self._pages.free(self._whole_pages(tokens))

    def _whole_pages(self, tokens: list[int]) -> list[int]:
        ps = self.page_size
        offsets: dict[int, set[int]] = {}
        for slot in tokens:
            if not ps <= slot < self.size + ps:
                raise InvalidSlot(
                    f"KV slot {slot} is out of range: expected {ps}..{self.size + ps - 1} "
                    f"(page 0, slots 0..{ps - 1}, is the reserved padding page)"
                )
            page = offsets.setdefault(slot // ps, set())
            if slot % ps in page:
                raise DoubleFree(f"KV slot {slot} is listed twice in one call")
            page.add(slot % ps)
        for page_id, seen in offsets.items():
            if len(seen) != ps:
                raise InvalidSlot(
                    f"page {page_id} is freed partially (offsets {sorted(seen)}); pages are "
                    f"freed whole: expected slots {page_id * ps}..{page_id * ps + ps - 1}"
                )
        return list(offsets)


class KVCache:
    """Per-layer K and V buffers indexed by KV token slot.

    Tensors (``dtype``, on ``device``, zero-initialised):
        k_buffers[layer], v_buffers[layer]: ``[size + page_size, num_kv_heads, head_dim]``.
            Slots ``0..page_size - 1`` are the padding page: zeros at first, then
            only the (finite) writes of padded rows; nothing live ever reads them.

    ``set_kv`` is graph-capturable and ``torch.compile``-friendly: it validates
    nothing that would need a device value.
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
        self.size, self.page_size = _check_page_geometry(size, page_size)
        self.num_layers = check_count("num_layers", num_layers, minimum=1)
        self.num_kv_heads = check_count("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = check_count("head_dim", head_dim, minimum=1)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (self.size + self.page_size, self.num_kv_heads, self.head_dim)
        self.k_buffers = [self._zeros(shape) for _ in range(self.num_layers)]
        self.v_buffers = [self._zeros(shape) for _ in range(self.num_layers)]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, num_kv_heads, head_dim]`` at slots ``loc`` (int64 ``[n]``).

        Padded rows carry slot 0; several may hit it in one call, which is fine:
        slot 0 is a sink nobody reads meaningfully.
        """
        self.k_buffers[layer].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffers[layer].index_copy_(0, loc, v.to(self.dtype))

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The full ``(k, v)`` buffers of ``layer``, ``[size + page_size, H, D]`` each."""
        return self.k_buffers[layer], self.v_buffers[layer]
