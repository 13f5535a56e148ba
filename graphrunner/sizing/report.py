"""What capture took and what replay did: plain records, no logic."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphrunner.sizing.sizes import PaddingWaste

__all__ = ["CaptureReport", "RunnerStats", "SizeReport"]


@dataclass(frozen=True, slots=True)
class SizeReport:
    """One captured size.

    seconds: wall time, warm-up (and compilation) included.
    memory_bytes: bytes this size added to the graphs' shared memory pool
        (None where nothing is pooled, e.g. on CPU); sizes after the first,
        captured largest first, mostly reuse what the first reserved.
    programs: inductor programs compiled for this size (1 when called
        directly; None where the mechanism compiles nothing).
    """

    bs: int
    seconds: float
    memory_bytes: int | None
    programs: int | None = None


@dataclass(slots=True)
class CaptureReport:
    """Every captured size, in capture order (largest first)."""

    sizes: list[SizeReport] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.sizes)

    @property
    def total_memory_bytes(self) -> int | None:
        mems = [s.memory_bytes for s in self.sizes]
        return None if any(m is None for m in mems) else sum(m for m in mems if m is not None)

    def format(self) -> str:
        """A table a person reads: one line per size, then the totals."""
        lines = []
        for s in self.sizes:
            mem = "" if s.memory_bytes is None else f"  {s.memory_bytes / 2**20:8.2f} MiB"
            progs = "" if s.programs is None else f"  {s.programs} program(s)"
            lines.append(f"  bs={s.bs:<4d} {s.seconds * 1e3:9.1f} ms{mem}{progs}")
        total_mem = self.total_memory_bytes
        mem = "" if total_mem is None else f"  {total_mem / 2**20:8.2f} MiB"
        lines.append(f"  total   {self.total_seconds * 1e3:9.1f} ms{mem}")
        return "\n".join(lines)


@dataclass(slots=True)
class RunnerStats:
    """Counters a runner keeps across replays (host integers only).

    ``replays`` counts graph replays and ``eager_fallbacks`` the batches above
    the largest graph; ``live_rows`` counts the rows of both, ``padded_rows``
    the padding the graphs ran.
    """

    replays: int = 0
    eager_fallbacks: int = 0
    live_rows: int = 0
    padded_rows: int = 0
    populate_ops: int = 0
    last_populate_ops: int = 0

    @property
    def padded_fraction(self) -> float:
        return PaddingWaste(self.live_rows, self.padded_rows).fraction

    def count_replay(self, raw_bs: int, bs: int, populate_ops: int) -> None:
        """One graph replay of ``raw_bs`` live rows padded to ``bs``."""
        self.replays += 1
        self.live_rows += raw_bs
        self.padded_rows += bs - raw_bs
        self.populate_ops += populate_ops
        self.last_populate_ops = populate_ops

    def count_eager(self, raw_bs: int) -> None:
        """One batch above the largest graph, run eagerly."""
        self.eager_fallbacks += 1
        self.live_rows += raw_bs
