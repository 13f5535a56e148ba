"""The padding fuzz: every captured size of a phase's runner replayed with
fewer live rows (and with as many), after the padded tail of every static
buffer was poisoned with hostile values; each live row's outputs compared
with the eager forward of the unpadded batch, the live state rows with the
state that forward left, and every other state row bit for bit with before.

The harness only poisons, replays and compares: populate is what writes the
pad values over the poison. Patterns (float tails, integer tails; bool tails
are always True, "advance this row"):

* ``nan/-1``: NaN, and -1 (wraps onto the last row of whatever it indexes);
* ``inf/out-of-range``: +inf, and the first value past each index's range
  (the vocabulary, request rows, KV slots, Mamba slots, context, width);
* ``-inf/live``: -inf, and the live rows' own values of the field, cycled
  over the tail (their request rows, KV slots, Mamba slots, ...): a padded
  row that kept one would write over that live request's state;
* ``max/bystander``: the largest finite float, and the index values of a
  request outside the batch (its row, one of its cached slots, its Mamba
  slot); fields that index no request state take the last live row's value.

The rows padded rows read (slot 0 of every KV layer and of the Mamba state)
hold the pattern's float too, which no live row may ever read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fuzz_cases import FuzzCase
from graphrunner.declare.buffers import Axis, BufferSpec, StepSize, units
from graphrunner.sanitizer.padding import PaddingViolation

#: Float tail, integer tail of each pattern (see the module doc).
PATTERNS = ("nan/-1", "inf/out-of-range", "-inf/live", "max/bystander")
#: The tolerance the phase oracles use for floats (compiled programs round
#: unlike eager); integers (token ids, parents, indices) must be equal.
RTOL = ATOL = 1e-5


@dataclass
class FuzzCounts:
    """What one phase on one mechanism replayed and found.

    ``paths``: the replay paths taken (``sanitized``, ``lean``);
    ``sizes``: distinct (captured size, live rows) pairs replayed;
    ``replays``: padded or full replays (paths x sizes x patterns x worlds); ``live_rows``:
    request rows whose outputs were compared; ``mismatches``: those that
    differed from eager; ``corruptions``: state rows that changed though no
    live row owns them, or live rows whose state differs from eager's;
    ``violations``: replays the sanitizer refused; ``errors``: replays that
    raised anything else (a poisoned index reaching a kernel); ``failures``:
    the first few findings, in words.
    """

    phase: str
    mechanism: str
    paths: list[str] = field(default_factory=list)
    sizes: list[tuple[int, int]] = field(default_factory=list)
    patterns: int = 0
    replays: int = 0
    live_rows: int = 0
    mismatches: int = 0
    corruptions: int = 0
    violations: int = 0
    errors: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.mismatches or self.corruptions or self.violations or self.errors)

    def note(self, what: str) -> None:
        if len(self.failures) < 8:
            self.failures.append(what)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sizes": [list(s) for s in self.sizes]}


def float_poison(pattern: str, dtype: torch.dtype) -> float:
    """The float ``pattern`` writes into float tails and the padding-read rows."""
    floats = pattern.split("/")[0]
    if floats == "max":
        return torch.finfo(dtype).max
    return {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[floats]


def tail_value(
    pattern: str, spec: BufferSpec, tail: torch.Tensor, case: FuzzCase, inputs: Any
) -> float | int | bool:
    """The one hostile value ``pattern`` fills ``spec``'s padded tail with
    (integer tails of ``live`` are copied from the live rows by :func:`poison_tails`)."""
    if tail.dtype == torch.bool:
        return True
    ints = pattern.split("/")[1]
    if tail.is_floating_point():
        return float_poison(pattern, tail.dtype)
    kind = spec.indexes.value if spec.indexes is not None else None
    if ints == "-1":
        return -1
    if ints == "out-of-range":
        return case.limits().get(kind or "", 2**31)
    return case.bystander().get(kind or "", int(getattr(inputs, spec.name).reshape(-1)[-1]))


def live_size(case: FuzzCase, raw_bs: int, inputs: Any) -> Any:
    """The step's live size: ``raw_bs`` requests, or for a token batch
    ``raw_bs`` tokens of the inputs' requests."""
    if case.runner.buffers.two_axes:
        return StepSize(raw_bs, inputs.batch_size)
    return raw_bs


def poison_tails(case: FuzzCase, raw_bs: int, pattern: str, inputs: Any) -> None:
    """Fill every static buffer past the live rows with the pattern."""
    bufs = case.runner.buffers
    size = live_size(case, raw_bs, inputs)
    for spec in bufs.specs:
        tail = bufs.tensors[spec.name][bufs.rows(spec, size) :]
        if pattern.endswith("/live") and not (tail.is_floating_point() or tail.dtype == torch.bool):
            live = getattr(inputs, spec.name).to(tail.device, tail.dtype)
            tail.copy_(live[torch.arange(tail.shape[0], device=tail.device) % live.shape[0]])
        else:
            tail.fill_(tail_value(pattern, spec, tail, case, inputs))


def _outputs(out: Any) -> dict[str, torch.Tensor]:
    items = out.items() if isinstance(out, dict) else [("out", out)]
    return {k: v.detach().clone() for k, v in items}


def _same(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise agreement: exact for integers and bools, the oracle tolerance for floats."""
    if got.is_floating_point():
        return torch.isclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=False)
    return got == want


def row_mismatches(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], raw_bs: int
) -> set[int]:
    """Live requests (0..raw_bs-1) whose outputs differ, a missing or misshapen one: all."""
    bad: set[int] = set()
    for name, w in want.items():
        g = got.get(name)
        if g is None or g.shape != w.shape or g.dtype != w.dtype:
            return set(range(raw_bs))
        ok = _same(g, w).reshape(raw_bs, -1).all(1)  # rows of a request are adjacent
        bad |= set(torch.nonzero(~ok).flatten().tolist())
    return bad


def corrupted_rows(
    name: str,
    before: torch.Tensor,
    after: torch.Tensor,
    expected: torch.Tensor,
    live: Iterable[int],
    sinks: Iterable[int],
) -> list[str]:
    """Rows of one state tensor that went wrong: changed outside the live and
    sink rows (bit for bit, NaN equal to NaN), or live rows unlike eager's."""
    changed = after != before
    if after.is_floating_point():
        changed &= ~(after.isnan() & before.isnan())
    changed_rows = changed.reshape(after.shape[0], -1).any(1)
    rows = sorted(live)
    allowed = torch.zeros_like(changed_rows)
    allowed[[*rows, *sinks]] = True
    found = [
        f"{name} row {r} changed, owned by no live row"
        for r in torch.nonzero(changed_rows & ~allowed).flatten().tolist()
    ]
    if rows:
        ok = _same(after[rows], expected[rows]).reshape(len(rows), -1).all(1)
        found += [
            f"{name} batch row {rows[i]} differs from eager"
            for i in torch.nonzero(~ok).flatten().tolist()
        ]
    return found


def check_replay(case: FuzzCase, raw_bs: int, pattern: str, seed: int, counts: FuzzCounts) -> None:
    """One poisoned replay of ``raw_bs`` live requests, compared with eager."""
    inputs = case.inputs(raw_bs, seed)
    garbage = case.state()
    for name, rows in case.padding_reads.items():
        garbage[name][rows] = float_poison(pattern, garbage[name].dtype)
    case.restore(garbage)
    before = case.state()
    with torch.no_grad():
        expected = _outputs(case.forward(inputs))
    expected_state = case.state()
    case.restore(before)
    poison_tails(case, raw_bs, pattern, inputs)
    bs = case.runner.graph_size_for(raw_bs)
    path = "sanitized" if case.runner.sanitizer is not None else "lean"
    where = f"{case.phase}/{counts.mechanism} {path} bs {bs} live {raw_bs} {pattern}"
    counts.replays += 1
    try:
        got = _outputs(case.runner.replay(inputs))
    except PaddingViolation as e:
        counts.violations += 1
        counts.note(f"{where}: sanitizer: {e}")
        return
    except Exception as e:  # a poisoned index that reached a kernel: a finding too
        counts.errors += 1
        counts.note(f"{where}: {type(e).__name__}: {e}")
        return
    after = case.state()
    counts.live_rows += raw_bs
    bad = row_mismatches(got, expected, units(Axis.REQUEST, live_size(case, raw_bs, inputs)))
    counts.mismatches += len(bad)
    if bad:
        counts.note(f"{where}: live rows {sorted(bad)} differ from eager")
    writable = case.writable(inputs)
    for name, now in after.items():
        found = corrupted_rows(
            name,
            before[name],
            now,
            expected_state[name],
            writable.get(name, []),
            case.sinks.get(name, []),
        )
        counts.corruptions += len(found)
        for f in found[:2]:
            counts.note(f"{where}: {f}")


#: The replay paths: under the case's sanitizer (every check, then the
#: launch), and the lean path a runner without one takes.
PATHS = ("sanitized", "lean")


def fuzz(
    make: Callable[[], FuzzCase],
    label: str,
    *,
    seeds: int = 1,
    patterns: Iterable[str] = PATTERNS,
    paths: Iterable[str] = PATHS,
) -> FuzzCounts:
    """Every live batch size 1..the largest captured size (so every captured
    size with fewer live rows than it, and with as many) under every pattern,
    ``seeds`` fresh worlds each, on each replay path (``sanitized`` needs a
    case made with its sanitizer; ``lean`` replays the same runner without it)."""
    case = make()
    runner, chosen, ways = case.runner, list(patterns), list(paths)
    counts = FuzzCounts(case.phase, label, patterns=len(chosen), paths=ways)
    sanitizer = runner.sanitizer
    if "sanitized" in ways and sanitizer is None:
        raise ValueError("paths: 'sanitized' needs a case made with its sanitizer")
    try:
        for path in ways:
            runner.sanitizer = sanitizer if path == "sanitized" else None
            for raw_bs in range(1, runner.max_bs + 1):
                pair = (runner.graph_size_for(raw_bs), raw_bs)
                if pair not in counts.sizes:
                    counts.sizes.append(pair)
                for p, pattern in enumerate(chosen):
                    for s in range(seeds):
                        seed = 1000 * raw_bs + 10 * p + s
                        check_replay(case, raw_bs, pattern, seed=seed, counts=counts)
    finally:
        runner.sanitizer = sanitizer
    return counts
