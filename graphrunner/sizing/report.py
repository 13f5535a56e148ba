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
    programs: inductor programs compiled while this size warmed up (0 where
        it reuses the one compiled for an earlier size; None where the
        mechanism compiles nothing).
    compile_seconds: of ``seconds``, the warm-ups that traced and compiled
        (0.0 where the size reused a program; None where nothing compiles).
    """

    bs: int
    seconds: float
    memory_bytes: int | None
    programs: int | None = None
    compile_seconds: float | None = None

    @property
    def capture_seconds(self) -> float:
        """``seconds`` less the compilation: warm-up runs, capture, the checks."""
        return self.seconds - (self.compile_seconds or 0.0)


@dataclass(slots=True)
class CaptureReport:
    """Every captured size, in capture order (largest first).

    compilations: inductor compilations the capture ran (0 where nothing
        compiles); cache_hits: of those, the ones inductor's or AOTAutograd's
        cache answered.
    """

    sizes: list[SizeReport] = field(default_factory=list)
    compilations: int = 0
    cache_hits: int = 0

    @property
    def start(self) -> str:
        """``"cold"`` where a compilation missed the caches, ``"warm"`` where
        every one hit, ``"none"`` where nothing compiled."""
        if not self.compilations:
            return "none"
        return "warm" if self.cache_hits == self.compilations else "cold"

    @property
    def compile_seconds(self) -> float:
        return sum(s.compile_seconds or 0.0 for s in self.sizes)

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
            lines.append(f"  bs={s.bs:<4d} {s.seconds * 1e3:9.1f} ms{_split(s)}{mem}{progs}")
        total_mem = self.total_memory_bytes
        mem = "" if total_mem is None else f"  {total_mem / 2**20:8.2f} MiB"
        lines.append(f"  total   {self.total_seconds * 1e3:9.1f} ms{mem}")
        if self.compilations:
            lines.append(f"  {self.describe_start()}")
        return "\n".join(lines)

    def describe_start(self) -> str:
        """One line: compilations, how many the caches answered, cold or warm."""
        n = self.compilations
        return (
            f"{self.start} start: {n} compilation(s) in {self.compile_seconds:.1f} s, "
            f"{self.cache_hits} of {n} from the compile caches"
        )


def _split(size: SizeReport) -> str:
    if size.compile_seconds is None:
        return ""
    return f" (compile {size.compile_seconds:6.2f} s, capture {size.capture_seconds * 1e3:7.1f} ms)"


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
