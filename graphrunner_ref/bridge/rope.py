"""RoPE whose frequencies transformers picks on the host, precomputed by position.

transformers' ``dynamic`` (NTK) and ``longrope`` rotary embeddings go through
its ``dynamic_rope_update`` decorator: each call takes ``torch.max(position_ids)
+ 1`` as the sequence length and decides the frequencies from it: a Python
``if`` on a tensor for ``dynamic`` (a graph break, so no fullgraph capture), a
``torch.where`` and a buffer rewritten in place for ``longrope`` (a program
the CPU runner cannot call directly). Either way the batch's largest position
decides every row's frequencies, padded rows included.

:func:`install_rope_tables` replaces each such module with a
:class:`RopeTable`: cos/sin of every position of the context, made at build
time by the module's own forward called once per position, ``0, 1, ...`` in
order, with ``position_ids [[p]]``: what transformers computes for one
sequence decoded token by token, where the step at position ``p`` has largest
position ``p``. The decode step looks its rows up by position (a gather: no
host sync, each row's values from its own position only). The eager prefill
(:meth:`RopeTable.transformers_rope`) calls a fresh copy of the original
module, so a prompt gets the frequencies transformers gives it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "RopeTable",
    "has_dynamic_rope",
    "host_rope_layer_types",
    "install_rope_tables",
    "is_host_rope",
]


def is_host_rope(rope_type: str) -> bool:
    """Whether transformers decides this RoPE type's frequencies on the host
    from the sequence length (the types ``dynamic_rope_update`` handles)."""
    return "dynamic" in rope_type or rope_type == "longrope"


def host_rope_layer_types(module: nn.Module) -> tuple[str | None, ...]:
    """The layer types of a rotary embedding module whose RoPE is decided on
    the host: ``(None,)`` for a module of one ``rope_type`` string with an
    ``inv_freq``; for one of a ``rope_type`` dict per layer type (Gemma3
    style, ``forward(x, position_ids, layer_type)``), each such layer type
    with a ``{layer_type}_inv_freq``; ``()`` for anything else."""
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, str):
        return (None,) if is_host_rope(rope_type) and hasattr(module, "inv_freq") else ()
    if isinstance(rope_type, dict):
        return tuple(
            layer
            for layer, kind in rope_type.items()
            if isinstance(kind, str) and is_host_rope(kind) and hasattr(module, f"{layer}_inv_freq")
        )
    return ()


def has_dynamic_rope(hf: nn.Module) -> bool:
    """Whether a rotary module of ``hf`` (or the original of its
    :class:`RopeTable`, from an earlier build) is dynamic NTK RoPE, which
    stretches its frequencies to run past ``max_position_embeddings``."""
    for module in hf.modules():
        original = module.original if isinstance(module, RopeTable) else module
        if any("dynamic" in _kind(original, t) for t in host_rope_layer_types(original)):
            return True
    return False


def _kind(module: nn.Module, layer_type: str | None) -> str:
    rope_type: Any = module.rope_type  # a str, or a dict of them by layer type
    kind: str = rope_type if layer_type is None else rope_type[layer_type]
    return kind


def _inv_freq(module: nn.Module, layer_type: str | None) -> torch.Tensor:
    inv_freq: torch.Tensor = getattr(
        module, "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"
    )
    return inv_freq


def _call(
    module: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # A module of one rope type takes no layer_type argument.
    if layer_type is None:
        cos, sin = module(x, position_ids)
    else:
        cos, sin = module(x, position_ids, layer_type=layer_type)
    return cos, sin


class RopeTable(nn.Module):
    """A rotary embedding module's cos/sin by position, in its place.

    Args:
        original: the model's rotary embedding module (kept as ``original``;
            it runs the eager prefill and any layer type not decided on the host).
        context: the positions tabled, ``0 .. context - 1``.
        dtype: the hidden states' dtype, which the module casts its cos/sin to.

    The buffers ``cos_{i}`` / ``sin_{i}`` (``[context, rotary_dim]``, not
    saved in a state dict) hold layer type ``layer_types[i]``.
    """

    def __init__(self, original: nn.Module, context: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.original = original
        self.layer_types = host_rope_layer_types(original)
        if not self.layer_types:
            raise ValueError(
                f"{type(original).__name__}: no rope_type decided on the host "
                "('dynamic...' or 'longrope') with its inv_freq to table"
            )
        #: Fresh copies of ``original`` while :meth:`transformers_rope` is entered.
        self._prefill: list[nn.Module] = []
        device = _inv_freq(original, self.layer_types[0]).device
        x = torch.zeros(1, 1, 1, dtype=dtype, device=device)  # only its dtype and device are read
        positions = torch.arange(context, device=device)
        with torch.no_grad():
            for layer in self.layer_types:
                # Position 0 is below every threshold: transformers resets a dynamic
                # module that grew in an earlier call, so the prefill copies start fresh.
                _call(original, x, positions[:1].view(1, 1), layer)
            for i, layer in enumerate(self.layer_types):
                cos, sin = self._tabulate(copy.deepcopy(original), x, positions, layer)
                self.register_buffer(f"cos_{i}", cos, persistent=False)
                self.register_buffer(f"sin_{i}", sin, persistent=False)

    @staticmethod
    def _tabulate(
        module: nn.Module, x: torch.Tensor, positions: torch.Tensor, layer: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One call per position in increasing order: the state a dynamic module
        # keeps (the longest length seen) follows the one sequence it would in
        # transformers' token-by-token decode, so each row is exactly the cos/sin
        # transformers' step at that position uses.
        rows = [
            _call(module, x, positions[p : p + 1].view(1, 1), layer) for p in range(len(positions))
        ]
        cos = torch.cat([c.reshape(1, -1) for c, _ in rows])
        sin = torch.cat([s.reshape(1, -1) for _, s in rows])
        return cos, sin

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[batch, T, rotary_dim]`` in ``x``'s dtype for ``position_ids``
        (int64 ``[batch, T]``, each in ``0 .. context - 1``)."""
        if self._prefill:
            return _call(self._prefill[-1], x, position_ids, layer_type)
        if layer_type not in self.layer_types:
            # Not decided on the host (a Gemma3-style module's other layer types).
            return _call(self.original, x, position_ids, layer_type)
        i = self.layer_types.index(layer_type)
        cos: torch.Tensor = getattr(self, f"cos_{i}")
        sin: torch.Tensor = getattr(self, f"sin_{i}")
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    @contextmanager
    def transformers_rope(self) -> Iterator[None]:
        """Within: the module computes as transformers' does, from a fresh copy
        of the original (no state carried from an earlier prompt), e.g. a
        prompt past ``longrope``'s threshold on the long factors at every position."""
        self._prefill.append(copy.deepcopy(self.original))
        try:
            yield
        finally:
            self._prefill.pop()


def install_rope_tables(hf: nn.Module, context: int, dtype: torch.dtype) -> list[RopeTable]:
    """Replace every rotary embedding module of ``hf`` whose RoPE is decided on
    the host (:func:`host_rope_layer_types`) with a :class:`RopeTable` over
    ``context`` positions, wherever it is registered; a table installed by an
    earlier build is rebuilt from its original. Returns the tables."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    originals: dict[int, nn.Module] = {}
    for parent in hf.modules():
        if isinstance(parent, RopeTable):
            continue  # its original is found through it
        for name, child in parent.named_children():
            original = child.original if isinstance(child, RopeTable) else child
            if isinstance(original, nn.Module) and host_rope_layer_types(original):
                places.setdefault(id(original), []).append((parent, name))
                originals[id(original)] = original
    tables = []
    for key, original in originals.items():
        table = RopeTable(original, context, dtype)
        for parent, name in places[key]:
            setattr(parent, name, table)
        tables.append(table)
    return tables
