"""The batch sizes a runner (or an engine) served, counted per raw size, and
the file they are written to and read from.

A histogram file is either a JSON object (what :meth:`BatchSizeHistogram.write`
writes)::

    {"format": "graphrunner.batch_sizes", "version": 1, "counts": {"3": 120, "7": 4}}

or plain text with one batch size per line (one line per step; blank lines
and ``#`` comments are skipped). Either feeds ``graphrunner sizes --trace``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from graphrunner.util import json_text
from graphrunner.util.atomic import write_atomically

__all__ = ["HISTOGRAM_FORMAT", "BatchSizeHistogram", "HistogramFileError", "read_histogram"]

HISTOGRAM_FORMAT = "graphrunner.batch_sizes"
_VERSION = 1


class HistogramFileError(ValueError):
    """A histogram file that cannot be read: names the file, the line or key, and the value."""


class BatchSizeHistogram:
    """Steps served per raw batch size (live rows, before padding).

    :meth:`add` is one dict increment: the runner calls it on every replay.
    Sizes are positive ints, counts positive ints; sizes never served are absent.
    """

    __slots__ = ("_counts",)

    def __init__(self, counts: Mapping[int, int] | None = None) -> None:
        self._counts: dict[int, int] = {}
        for bs, n in (counts or {}).items():
            _check_entry(bs, n, "counts")
            if n:
                self._counts[bs] = n

    def add(self, raw_bs: int) -> None:
        """Count one step of ``raw_bs`` live rows."""
        counts = self._counts
        counts[raw_bs] = counts.get(raw_bs, 0) + 1

    def counts(self) -> dict[int, int]:
        """A copy: ``{raw batch size: steps}``, sorted by size."""
        return dict(sorted(self._counts.items()))

    @property
    def steps(self) -> int:
        return sum(self._counts.values())

    @property
    def rows(self) -> int:
        """Live rows over every counted step."""
        return sum(bs * n for bs, n in self._counts.items())

    def clear(self) -> None:
        self._counts.clear()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchSizeHistogram):
            return NotImplemented
        return self._counts == other._counts

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"BatchSizeHistogram({self.counts()})"

    def to_json(self) -> str:
        counts = {str(bs): n for bs, n in self.counts().items()}
        return json.dumps({"format": HISTOGRAM_FORMAT, "version": _VERSION, "counts": counts})

    def write(self, path: str | Path) -> None:
        """Write the JSON form to ``path``, atomically (complete or untouched)."""
        write_atomically(Path(path), self.to_json() + "\n")

    @classmethod
    def from_sizes(cls, sizes: Iterable[int]) -> BatchSizeHistogram:
        """One step per element of ``sizes``."""
        hist = cls()
        for i, bs in enumerate(sizes):
            _check_entry(bs, 1, f"sizes[{i}]")
            hist.add(bs)
        return hist


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_entry(bs: object, n: object, where: str) -> None:
    if not _is_int(bs) or bs < 1:  # type: ignore[operator]
        raise ValueError(f"{where}: batch size {bs!r}; expected an int >= 1")
    if not _is_int(n) or n < 0:  # type: ignore[operator]
        raise ValueError(f"{where}[{bs}]: count {n!r}; expected an int >= 0")


def read_histogram(path: str | Path) -> BatchSizeHistogram:
    """Read a histogram file (JSON or one size per line); raises
    :class:`HistogramFileError` naming the file and the bad line or entry, and
    on a file with no batch at all."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HistogramFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise HistogramFileError(f"{path}: is a directory; expected a histogram file") from None
    except UnicodeDecodeError:
        raise HistogramFileError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise HistogramFileError(f"{path}: {e.strerror}") from None
    hist = _parse_json(path, text) if text.lstrip().startswith("{") else _parse_lines(path, text)
    if not hist.steps:
        raise HistogramFileError(f"{path}: no batch sizes; expected at least one step")
    return hist


def _parse_json(path: Path, text: str) -> BatchSizeHistogram:
    try:
        data = json_text.loads(text)
    except json.JSONDecodeError as e:
        raise HistogramFileError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except json_text.JSONLimitError as e:
        raise HistogramFileError(f"{path}: not a histogram ({e})") from None
    if data.get("format") != HISTOGRAM_FORMAT or data.get("version") != _VERSION:
        raise HistogramFileError(
            f"{path}: format {data.get('format')!r} version {data.get('version')!r}; "
            f"expected {HISTOGRAM_FORMAT!r} version {_VERSION}"
        )
    counts = data.get("counts")
    if not isinstance(counts, dict):
        raise HistogramFileError(f"{path}: 'counts' is {counts!r}; expected an object")
    parsed: dict[int, int] = {}
    for key, n in counts.items():
        bs = _digits(key)
        if bs is None:
            raise HistogramFileError(
                f"{path}: counts: batch size {key[:40]!r}; expected an int >= 1"
            )
        try:
            _check_entry(bs, n, f"{path}: counts")
        except ValueError as e:
            raise HistogramFileError(str(e)) from None
        parsed[bs] = n
    return BatchSizeHistogram(parsed)


def _parse_lines(path: Path, text: str) -> BatchSizeHistogram:
    hist = BatchSizeHistogram()
    for lineno, line in enumerate(text.splitlines(), start=1):
        field = line.split("#", 1)[0].strip()
        if not field:
            continue
        bs = _digits(field)
        if bs is None or bs < 1:
            raise HistogramFileError(
                f"{path}:{lineno}: {line.strip()[:40]!r}; expected one batch size (an int >= 1)"
            )
        hist.add(bs)
    return hist


def _digits(text: str) -> int | None:
    """The int that ``text`` spells in ASCII digits, or None (other text, or
    more digits than Python converts)."""
    if not (text.isascii() and text.isdigit()):
        return None
    try:
        return int(text)
    except ValueError:  # past the digit limit
        return None
