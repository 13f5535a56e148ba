"""A capture report as a JSON file: what ``graphrunner sizes --capture-report``
reads for the bytes of each size.

::

    {"format": "graphrunner.capture_report", "version": 1, "mechanism": "cuda",
     "compilations": 0, "cache_hits": 0,
     "sizes": [{"bs": 256, "seconds": 0.41, "memory_bytes": 35651584, "programs": null,
                "compile_seconds": null}, ...]}

``memory_bytes`` is null where the mechanism pools nothing (the CPU).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from graphrunner.sizing.report import CaptureReport, SizeReport
from graphrunner.util import json_text
from graphrunner.util.atomic import write_atomically

__all__ = [
    "REPORT_FORMAT",
    "ReportFileError",
    "capture_report_json",
    "read_capture_report",
    "write_capture_report",
]

REPORT_FORMAT = "graphrunner.capture_report"
_VERSION = 1


class ReportFileError(ValueError):
    """A capture-report file that cannot be read: names the file, the entry and the value."""


def capture_report_json(report: CaptureReport, mechanism: str) -> str:
    sizes = [
        {
            "bs": s.bs,
            "seconds": s.seconds,
            "memory_bytes": s.memory_bytes,
            "programs": s.programs,
            "compile_seconds": s.compile_seconds,
        }
        for s in report.sizes
    ]
    doc = {
        "format": REPORT_FORMAT,
        "version": _VERSION,
        "mechanism": mechanism,
        "compilations": report.compilations,
        "cache_hits": report.cache_hits,
        "sizes": sizes,
    }
    return json.dumps(doc, indent=1)


def write_capture_report(report: CaptureReport, path: str | Path, *, mechanism: str) -> None:
    """Write ``report`` (captured by ``mechanism``, its label) to ``path``, atomically."""
    write_atomically(Path(path), capture_report_json(report, mechanism) + "\n")


def read_capture_report(path: str | Path) -> tuple[CaptureReport, str]:
    """The report of a file :func:`write_capture_report` wrote, and its mechanism label."""
    path = Path(path)
    try:
        doc = json_text.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReportFileError(f"{path}: no such file") from None
    except (IsADirectoryError, UnicodeDecodeError):
        raise ReportFileError(f"{path}: expected a UTF-8 JSON file") from None
    except json.JSONDecodeError as e:
        raise ReportFileError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    except json_text.JSONLimitError as e:
        raise ReportFileError(f"{path}: not a capture report ({e})") from None
    except OSError as e:
        raise ReportFileError(f"{path}: {e.strerror}") from None
    if not isinstance(doc, dict) or doc.get("format") != REPORT_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ReportFileError(f"{path}: format {got!r}; expected {REPORT_FORMAT!r}")
    if doc.get("version") != _VERSION:
        raise ReportFileError(f"{path}: version {doc.get('version')!r}; expected {_VERSION}")
    entries = doc.get("sizes")
    if not isinstance(entries, list) or not entries:
        raise ReportFileError(f"{path}: 'sizes' is {entries!r}; expected a non-empty list")
    report = CaptureReport([_size(path, i, e) for i, e in enumerate(entries)])
    report.compilations = _int_entry(str(path), doc, "compilations", 0) or 0
    report.cache_hits = _int_entry(str(path), doc, "cache_hits", 0) or 0
    seen = [s.bs for s in report.sizes]
    if len(set(seen)) != len(seen):
        raise ReportFileError(f"{path}: sizes {seen} repeat a batch size; expected each once")
    return report, str(doc.get("mechanism", ""))


def _size(path: Path, i: int, entry: Any) -> SizeReport:
    where = f"{path}: sizes[{i}]"
    if not isinstance(entry, dict):
        raise ReportFileError(f"{where} = {entry!r}; expected an object")
    bs = _int_entry(where, entry, "bs", 1)
    if bs is None:
        raise ReportFileError(f"{where}.bs = None; expected an int >= 1")
    seconds = _seconds_entry(where, entry, "seconds")
    if seconds is None:
        raise ReportFileError(f"{where}.seconds = None; expected a number >= 0")
    memory = _int_entry(where, entry, "memory_bytes", 0)
    programs = _int_entry(where, entry, "programs", 0)
    return SizeReport(
        bs, seconds, memory, programs, _seconds_entry(where, entry, "compile_seconds")
    )


def _seconds_entry(where: str, entry: dict[str, Any], key: str) -> float | None:
    """``entry[key]``: a finite number >= 0, or None (absent or null)."""
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReportFileError(f"{where}.{key} = {value!r}; expected a number >= 0")
    if not (math.isfinite(value) and value >= 0):
        raise ReportFileError(f"{where}.{key} = {value!r}; expected a number >= 0")
    return float(value)


def _int_entry(where: str, entry: dict[str, Any], key: str, lo: int) -> int | None:
    """``entry[key]``: an int >= ``lo``, or None (absent or null)."""
    value = entry.get(key)
    if value is None:
        return None
    if not _int_at_least(value, lo):
        raise ReportFileError(f"{where}.{key} = {value!r}; expected an int >= {lo} or null")
    return int(value)


def _int_at_least(x: object, lo: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo
