"""What capture took and what replay did: plain records, no logic."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphrunner.sizes import PaddingWaste

__all__ = ["CaptureReport", "RunnerStats", "SizeReport"]


@dataclass(frozen=True, slots=True)
class SizeReport:
    """One captured size: wall seconds (warm-up included) and device bytes taken
    (None where the runner cannot measure it, e.g. on CPU)."""

    bs: int
    seconds: float
    memory_bytes: int | None


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
            lines.append(f"  bs={s.bs:<4d} {s.seconds * 1e3:9.1f} ms{mem}")
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
