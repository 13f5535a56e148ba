"""Capture sizes chosen from served traffic: the list of at most N sizes that
minimises the expected padded rows of a batch-size histogram, exactly.

A batch of ``b`` live rows replays the smallest captured size ``c >= b`` and
computes ``c - b`` padded rows; a batch above the largest size runs eagerly,
unpadded. Over a histogram ``{b: steps}`` the expected waste is padded rows /
rows computed (:class:`~graphrunner.sizing.sizes.PaddingWaste`).

An optimal list only ever holds sizes that occur in the traffic (lowering a
size to the largest served size at or below it pads less), plus the largest
size, which is always captured. Over those ``k`` candidates, sorted, a
dynamic programme over "the last size chosen is candidate j, using n sizes"
finds the optimum: ``cost(i, j)``, the padding of the batches in
``(c_i, c_j]`` padded to ``c_j``, comes from two prefix sums, so a step is
O(1) and the whole search O(N k^2) — vectorised over ``i``.

With a memory budget (:func:`budget_capture_sizes`) the candidates are the
sizes of a capture report, each with the bytes it added to the graphs' pool,
and the programme keeps, per state, every (bytes, padded rows) pair that no
other pair beats on both (a Pareto front), so the optimum under the budget is
exact too. A size's bytes are those it added when the report's list was
captured, largest first into one pool: their sum over a subset estimates that
subset's pool, with the largest size (always kept) carrying most of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from graphrunner.sizing.sizes import PaddingWaste, pad_to, validate_capture_sizes

__all__ = ["SizePlan", "budget_capture_sizes", "expected_waste", "optimal_capture_sizes"]

#: Every value the programme adds must stay far from int64 overflow.
_INT64_ROOM = 2**60


@dataclass(frozen=True, slots=True)
class SizePlan:
    """A capture list and what it costs on the histogram it was chosen for.

    sizes: ascending, the largest last. waste: expected live and padded rows.
    memory_bytes: the sum of the sizes' report bytes (budgeted plans), else None.
    """

    sizes: tuple[int, ...]
    waste: PaddingWaste
    memory_bytes: int | None = None


def expected_waste(sizes: Sequence[int], counts: Mapping[int, int]) -> PaddingWaste:
    """Live and padded rows if every step of ``counts`` ({raw bs: steps})
    replays the smallest of ``sizes`` that holds it (above the largest: eager)."""
    sizes = validate_capture_sizes(sizes)
    live = padded = 0
    for bs, n in _checked_counts(counts).items():
        live += bs * n
        if bs <= sizes[-1]:
            padded += (pad_to(sizes, bs) - bs) * n
    return PaddingWaste(live, padded)


def optimal_capture_sizes(
    counts: Mapping[int, int], graphs: int, *, max_bs: int | None = None
) -> SizePlan:
    """The list of at most ``graphs`` sizes, ``max_bs`` included (default: the
    largest served size), with the fewest expected padded rows over ``counts``.

    Fewer sizes only where more would not pad less (every served size already
    captured); among equal optima, the fewest sizes, then the smallest.
    """
    counts = _checked_counts(counts)
    _check_positive("graphs", graphs)
    top = max(counts) if max_bs is None else _check_positive("max_bs", max_bs)
    cands = sorted({bs for bs in counts if bs < top} | {top})
    weights, sums = _prefix(cands, counts)
    _check_room(cands, weights, sums)
    sizes, padded = _search(np.array(cands), np.array(weights), np.array(sums), graphs)
    return SizePlan(tuple(cands[i] for i in sizes), PaddingWaste(_live(counts), padded))


def budget_capture_sizes(
    counts: Mapping[int, int],
    graphs: int,
    size_bytes: Mapping[int, int],
    budget: int,
    *,
    max_bs: int | None = None,
) -> SizePlan:
    """The list of at most ``graphs`` sizes taken from ``size_bytes`` ({captured
    size: bytes}, a capture report's), ``max_bs`` included (default: the
    report's largest), whose bytes sum to at most ``budget``, with the fewest
    expected padded rows over ``counts``; ties go to fewer bytes, then fewer sizes.

    Raises ValueError when ``max_bs`` is not in the report or alone exceeds the budget.
    """
    counts = _checked_counts(counts)
    _check_positive("graphs", graphs)
    if not size_bytes:
        raise ValueError("size_bytes is empty; expected the bytes of at least one size")
    for bs, b in size_bytes.items():
        _check_positive("size_bytes key", bs)
        if not _is_int(b) or b < 0:
            raise ValueError(f"size_bytes[{bs}] = {b!r}; expected an int >= 0")
    if not _is_int(budget) or budget < 0:
        raise ValueError(f"budget = {budget!r}; expected an int >= 0 (bytes)")
    top = max(size_bytes) if max_bs is None else max_bs
    if top not in size_bytes:
        raise ValueError(f"max_bs {top} is not a size of the report {sorted(size_bytes)}")
    if size_bytes[top] > budget:
        raise ValueError(
            f"budget {budget} bytes is below the {size_bytes[top]} bytes of the "
            f"largest size {top} alone"
        )
    cands = sorted(bs for bs in size_bytes if bs <= top)
    weights, sums = _prefix(cands, counts)
    best = _pareto_search(cands, weights, sums, [size_bytes[c] for c in cands], graphs, budget)
    nbytes, padded, chosen = best
    return SizePlan(tuple(chosen), PaddingWaste(_live(counts), padded), nbytes)


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_positive(name: str, value: object) -> int:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name} = {value!r}; expected an int >= 1")
    return int(value)  # type: ignore[call-overload]


def _checked_counts(counts: Mapping[int, int]) -> dict[int, int]:
    """``counts`` as plain ints without zero entries; at least one step."""
    out: dict[int, int] = {}
    for bs, n in counts.items():
        _check_positive("batch size", bs)
        if not _is_int(n) or n < 0:
            raise ValueError(f"counts[{bs}] = {n!r}; expected an int >= 0 (steps)")
        if n:
            out[int(bs)] = int(n)
    if not out:
        raise ValueError("counts has no steps; expected at least one served batch")
    return out


def _live(counts: Mapping[int, int]) -> int:
    return sum(bs * n for bs, n in counts.items())


def _prefix(cands: Sequence[int], counts: Mapping[int, int]) -> tuple[list[int], list[int]]:
    """Steps and live rows of the batches at or below each candidate."""
    served = sorted(counts.items())
    weights, sums = [], []
    w = s = k = 0
    for c in cands:
        while k < len(served) and served[k][0] <= c:
            w, s, k = w + served[k][1], s + served[k][0] * served[k][1], k + 1
        weights.append(w)
        sums.append(s)
    return weights, sums


def _check_room(cands: Sequence[int], weights: Sequence[int], sums: Sequence[int]) -> None:
    if cands[-1] * weights[-1] >= _INT64_ROOM or sums[-1] >= _INT64_ROOM:
        raise ValueError(
            f"{weights[-1]} steps up to batch size {cands[-1]}: too many rows for exact "
            f"int64 sums; expected steps * max_bs < 2**60"
        )


def _search(
    cands: np.ndarray, weights: np.ndarray, sums: np.ndarray, graphs: int
) -> tuple[list[int], int]:
    """Indices of the optimal candidates (the last always in) and their padded rows.

    ``best[j]``: the fewest padded rows of the batches up to ``cands[j]`` with
    ``n`` sizes, the largest ``cands[j]``; from ``n - 1`` to ``n`` it is
    ``min_i best[i] + cands[j] * (W[j] - W[i]) - (S[j] - S[i])`` over ``i < j``.
    """
    k = len(cands)
    inf = np.int64(_INT64_ROOM)
    best = cands * weights - sums  # one size: everything padded to cands[j]
    parents: list[np.ndarray] = []
    top_n, top = 1, int(best[-1])
    for n in range(2, min(graphs, k) + 1):
        base = best + sums  # the part of the step that depends on i alone
        new = np.full(k, inf, dtype=np.int64)
        parent = np.full(k, -1, dtype=np.int64)
        for j in range(n - 1, k):
            vals = base[:j] - cands[j] * weights[:j]
            i = int(np.argmin(vals))
            new[j] = vals[i] + cands[j] * weights[j] - sums[j]
            parent[j] = i
        # States j < n - 1 (fewer candidates than sizes) stay at inf: a chain
        # through one costs at least inf, above any reachable total (< 2**60).
        best = new
        parents.append(parent)
        if int(best[-1]) < top:
            top_n, top = n, int(best[-1])
    chosen = [k - 1]
    for n in range(top_n, 1, -1):
        chosen.append(int(parents[n - 2][chosen[-1]]))
    return chosen[::-1], top


# One Pareto entry: bytes, padded rows, candidate index, the entry before it (or None).
_Entry = tuple[int, int, int, "_Entry | None"]


def _front(entries: list[_Entry]) -> list[_Entry]:
    """Keep the entries no other beats on both bytes and padded rows."""
    entries.sort(key=lambda e: (e[0], e[1]))
    kept: list[_Entry] = []
    for e in entries:
        if not kept or e[1] < kept[-1][1]:
            kept.append(e)
    return kept


def _pareto_search(
    cands: Sequence[int],
    weights: Sequence[int],
    sums: Sequence[int],
    nbytes: Sequence[int],
    graphs: int,
    budget: int,
) -> tuple[int, int, list[int]]:
    """Bytes, padded rows and sizes of the budgeted optimum (exact, Python ints)."""
    k = len(cands)
    layer: list[list[_Entry]] = [
        [(nbytes[j], cands[j] * weights[j] - sums[j], j, None)] if nbytes[j] <= budget else []
        for j in range(k)
    ]
    finals = list(layer[-1])
    for _ in range(2, min(graphs, k) + 1):
        nxt: list[list[_Entry]] = [[] for _ in range(k)]
        for j in range(1, k):
            step: list[_Entry] = []
            for i in range(j):
                cost = cands[j] * (weights[j] - weights[i]) - (sums[j] - sums[i])
                for e in layer[i]:
                    b = e[0] + nbytes[j]
                    if b <= budget:
                        step.append((b, e[1] + cost, j, e))
            nxt[j] = _front(step)
        layer = nxt
        finals.extend(layer[-1])
    # Fewest padded rows, then fewest bytes, then fewest sizes.
    b, padded, _, _ = best = min(finals, key=lambda e: (e[1], e[0], _length(e)))
    chosen: list[int] = []
    entry: _Entry | None = best
    while entry is not None:
        chosen.append(cands[entry[2]])
        entry = entry[3]
    return b, padded, chosen[::-1]


def _length(entry: _Entry | None) -> int:
    n = 0
    while entry is not None:
        n, entry = n + 1, entry[3]
    return n
