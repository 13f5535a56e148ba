"""A row's greedy token on the CPU, eagerly, at the speed of a max.

ATen's CPU ``argmax`` over a row's last dimension reads about 0.7 G floats a
second on one thread (SmolLM2's ``[8, 49152]`` logits: 570 us), where
``amax`` reads 13 G (30 us): it carries an index beside every value. A saved
program's greedy step runs its sampler eagerly after the model
(:class:`~graphrunner.mechanisms.base.SplitForward`), so that argmax was a
step's slowest operation after the model. :func:`row_argmax` gives the same
index in two passes of max: the maximum of each block of a row, the first
block holding the row's maximum, then the first index of it in that block.
"""

from __future__ import annotations

import torch

__all__ = ["row_argmax"]

#: Values a block: the first pass reduces contiguous blocks of this many.
BLOCK = 128


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of a float ``[n, V]`` tensor, bit for bit (the
    first index among equal maxima; a NaN counts as the maximum, as for
    ``argmax``): int64 ``[n]``.

    Two passes on an eager CPU tensor: each block's maximum (``amax``), the
    first block whose maximum is the row's (``argmax`` over ``V / BLOCK``
    values: any earlier occurrence of the row's maximum would make an
    earlier block's maximum equal to it), then ``argmax`` within that block.
    Elsewhere (a compiled step, another device) ``argmax`` itself.
    """
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 2 * BLOCK or torch.compiler.is_compiling():
        return logits.argmax(-1)
    whole = vocab - vocab % BLOCK
    maxima = logits[:, :whole].reshape(rows, whole // BLOCK, BLOCK).amax(-1)
    if whole < vocab:  # the last, shorter block
        maxima = torch.cat([maxima, logits[:, whole:].amax(-1, keepdim=True)], dim=-1)
    start = maxima.argmax(-1, keepdim=True) * BLOCK
    # The block's indices; past the row's end they repeat its last index,
    # which never comes first among equal values (its own place is earlier).
    within = (start + torch.arange(BLOCK)).clamp_(max=vocab - 1)
    return (start + logits.gather(-1, within).argmax(-1, keepdim=True)).squeeze(-1)
