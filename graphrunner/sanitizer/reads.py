"""Read isolation: a live row's outputs depend on its own inputs and the state
its request owns, not on the padding sinks or the padded rows.

Writes are checked by comparing the guarded state before and after a launch;
a stray *read* leaves no trace there. So, under the sanitizer, a padded
replay is launched a second time: the guarded state put back as it was
before the first launch, then every sink (row 0, and rows ``0..sink_rows-1``,
of each floating guarded tensor: KV slot 0, Mamba slot 0), every row no live
row owns (free KV slots and other requests' slots, free request and Mamba
rows: :func:`unowned_rows`) and every padded row's value inputs (floating
buffers, and token ids: random ones below the vocabulary when it is known,
else the live rows' own ids, always valid) set to other values. The live
rows' outputs must come out the same; a difference raises
:class:`~graphrunner.sanitizer.padding.PaddingViolation` naming the output,
the batch row and what it depended on. The state of the first launch is
restored afterwards, so the step's effect is the first launch's. This
catches a row attending one column past its length (that column is the sink
slot 0), rows that mix (a batch statistic over padded rows, their embedded
token ids included), and a padded row's input reaching a live row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from graphrunner.declare.buffers import Axis, Size, StaticBuffers, units
from graphrunner.declare.decode import OUT_CACHE_LOC, REQ_POOL_INDICES, SEQ_LENS
from graphrunner.declare.indexes import Index
from graphrunner.declare.outputs import Outputs, named_outputs
from graphrunner.sanitizer.checks import GuardedTensor, PaddingViolation

__all__ = ["check_reads", "unowned_rows"]

#: How far a live output may move when nothing it may read changed (the
#: same program on the same live inputs: in practice bit-equal).
_RTOL = _ATOL = 1e-6


def _perturb(
    t: torch.Tensor, gen: torch.Generator, vocab: int | None, ids: torch.Tensor | None = None
) -> None:
    """``t`` in place: other finite values of its kind (for an integer tensor,
    a token id below ``vocab`` when ``vocab`` is given, else one of ``ids``,
    the live rows' own, so every id stays one the model can embed)."""
    if not t.numel():
        return
    if t.is_floating_point():
        noise = torch.randn(t.shape, generator=gen, device=gen.device, dtype=torch.float32)
        t.copy_(noise.mul_(3).add_(1))
    elif vocab is not None:
        t.copy_(torch.randint(0, vocab, t.shape, generator=gen, device=gen.device))
    elif ids is not None and ids.numel():
        pick = torch.randint(0, ids.numel(), t.shape, generator=gen, device=gen.device)
        t.copy_(ids.reshape(-1)[pick])


def _tails(
    buffers: StaticBuffers, raw_bs: Size, bs: Size
) -> list[tuple[str, torch.Tensor, torch.Tensor | None, bool]]:
    """The padded rows of every buffer a value may stand in: floating ones,
    token ids (the other index buffers keep pointing at the sinks) and a
    token batch's token rows; each with the values an integer one takes (a
    token buffer's live ids; for token rows, the padded token rows, so a
    padded request reads a padded token: None where there is none), and
    whether they are token ids (then any id below the vocabulary will do)."""
    out = []
    for spec in buffers.specs:
        tensor = buffers.tensors.get(spec.name)
        if tensor is None or spec.host:
            continue
        token, row = spec.indexes is Index.TOKEN, spec.indexes is Index.TOKEN_ROW
        if not (tensor.is_floating_point() or token or row):
            continue
        live = buffers.rows(spec, raw_bs)
        ids = tensor[:live].clone() if token else None
        if row:
            first, end = units(Axis.TOKEN, raw_bs), units(Axis.TOKEN, bs)
            if first == end:
                continue  # no padded token to point at: the rows stay
            ids = torch.arange(first, end, device=tensor.device)
        out.append((spec.name, tensor[live : buffers.rows(spec, bs)], ids, token))
    return out


def _live(inputs: object, name: str) -> torch.Tensor | None:
    """Field ``name``'s values in the live inputs, flattened (None where absent)."""
    t = getattr(inputs, name, None)
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or not t.dim():
        return None
    return t.reshape(-1).long()


def unowned_rows(
    guard: GuardedTensor, inputs: object, raw_bs: Size, req_to_token: torch.Tensor | None
) -> torch.Tensor | None:
    """A bool mask of ``guard``'s rows no live row owns, which no live output
    may depend on; None where ownership is not known (state only read, as
    ``req_to_token``: its sinks alone are changed).

    KV slots (written at ``out_cache_loc``): owned are each live request's
    ``req_to_token[row, :seq_lens]`` and the slots this step writes. Rows
    written at another field (``req_pool_indices``, Mamba slots): its live
    values."""
    if guard.writer is None or not guard.tensor.is_floating_point():
        return None
    writes = _live(inputs, guard.writer)
    if writes is None:
        return None
    owned = torch.zeros(guard.tensor.shape[0], dtype=torch.bool, device=guard.tensor.device)
    owned[writes.to(owned.device)] = True
    if guard.writer == OUT_CACHE_LOC:
        rows, lens = _live(inputs, REQ_POOL_INDICES), _live(inputs, SEQ_LENS)
        if req_to_token is None or rows is None or lens is None:
            return None
        live = units(Axis.REQUEST, raw_bs)
        rows, lens = rows[:live].to(req_to_token.device), lens[:live].to(req_to_token.device)
        columns = torch.arange(req_to_token.shape[1], device=req_to_token.device)
        cached = req_to_token[rows][columns[None, :] < lens[:, None]]
        owned[cached.long().to(owned.device)] = True
    return ~owned


def check_reads(
    guarded: Sequence[GuardedTensor],
    before: Sequence[torch.Tensor],
    buffers: StaticBuffers,
    raw_bs: Size,
    bs: Size,
    first: Outputs,
    relaunch: Callable[[], Outputs],
    *,
    vocab_size: int | None = None,
    seed: int = 0,
    unowned: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Relaunch with the sinks, the unowned rows and the padded rows' value
    inputs changed (see the module); raise :class:`PaddingViolation` if a
    live output moved.

    ``before``: each guarded tensor as it was before the first launch;
    ``first``: the first launch's live outputs (views are copied here);
    ``unowned``: each guarded tensor's :func:`unowned_rows` (None: sinks only).
    """
    expected = [(name, t.clone()) for name, t in named_outputs(first)]
    after = [g.tensor.clone() for g in guarded]
    device = buffers.device
    gen = torch.Generator(device=device).manual_seed(seed)
    sinks: list[str] = []
    others: list[str] = []
    masks = list(unowned) if unowned is not None else [None] * len(guarded)
    try:
        for guard, old, mask in zip(guarded, before, masks, strict=True):
            guard.tensor.copy_(old)
            if guard.tensor.is_floating_point():  # row 0 is padding everywhere
                _perturb(guard.tensor[: max(guard.sink_rows, 1)], gen, None)
                sinks.append(guard.name)
            if mask is not None and bool(mask[max(guard.sink_rows, 1) :].any()):
                rows = mask.nonzero().flatten()
                values = guard.tensor[rows]
                _perturb(values, gen, None)
                guard.tensor[rows] = values
                others.append(f"{guard.name}'s {guard.row_name}s no live row owns")
        tails = _tails(buffers, raw_bs, bs)
        saved = [(t, t.clone()) for _, t, _, _ in tails]
        for _, tail, ids, token in tails:
            _perturb(tail, gen, vocab_size if token else None, ids)
        second = dict(named_outputs(relaunch()))
        for tail, value in saved:
            tail.copy_(value)
    finally:  # the step's effect is the first launch's
        for guard, value in zip(guarded, after, strict=True):
            guard.tensor.copy_(value)
    padded = sum(bs) - sum(raw_bs) if isinstance(bs, tuple) else bs - raw_bs  # type: ignore[arg-type, operator]
    depends = _what(sinks, [name for name, _, _, _ in tails], padded, others)
    for name, want in expected:
        got = second[name]
        same = (
            torch.isclose(got, want, rtol=_RTOL, atol=_ATOL, equal_nan=True)
            if want.is_floating_point()
            else got == want
        )
        if bool(same.all()):
            continue
        row = int((~same).reshape(want.shape[0], -1).any(1).nonzero()[0, 0])
        raise PaddingViolation(
            f"output {name!r}, batch row {row}: changed when only {depends} changed; a live "
            "row's outputs must depend on its own inputs and its request's state alone "
            "(a read past its length reaches the sink, a statistic over the batch the "
            "padded rows)"
        )


def _what(sinks: list[str], tails: list[str], padded: int, others: list[str]) -> str:
    parts = []
    if sinks:
        parts.append(f"the sinks of {', '.join(sinks)}")
    parts += others
    if tails and padded:
        parts.append(f"the {padded} padded rows' {', '.join(tails)}")
    return " and ".join(parts) or "nothing it may read"
