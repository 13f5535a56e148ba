"""Which batch sizes to capture: padding to the next captured size, the
waste it costs, size plans from a histogram of observed batch sizes, and the
capture report. The planning and report-file tools load on first use (a
runner never needs them)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from graphrunner.sizing.histogram import BatchSizeHistogram, HistogramFileError, read_histogram
from graphrunner.sizing.report import CaptureReport, RunnerStats, SizeReport
from graphrunner.sizing.sizes import (
    BatchSizeError,
    PaddingWaste,
    default_capture_sizes,
    default_token_sizes,
    pad_to,
    padding_waste,
)

if TYPE_CHECKING:
    from graphrunner.sizing.plan import (
        SizePlan,
        budget_capture_sizes,
        expected_waste,
        optimal_capture_sizes,
    )
    from graphrunner.sizing.report_file import (
        ReportFileError,
        read_capture_report,
        write_capture_report,
    )

#: Names of the tools loaded on first use, by module.
_LAZY = {
    "graphrunner.sizing.plan": (
        "SizePlan",
        "budget_capture_sizes",
        "expected_waste",
        "optimal_capture_sizes",
    ),
    "graphrunner.sizing.report_file": (
        "ReportFileError",
        "read_capture_report",
        "write_capture_report",
    ),
}

__all__ = [
    "BatchSizeError",
    "BatchSizeHistogram",
    "CaptureReport",
    "HistogramFileError",
    "PaddingWaste",
    "ReportFileError",
    "RunnerStats",
    "SizePlan",
    "SizeReport",
    "budget_capture_sizes",
    "default_capture_sizes",
    "default_token_sizes",
    "expected_waste",
    "optimal_capture_sizes",
    "pad_to",
    "padding_waste",
    "read_capture_report",
    "read_histogram",
    "write_capture_report",
]


def __getattr__(name: str) -> object:
    for module, names in _LAZY.items():
        if name in names:
            return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'graphrunner.sizing' has no attribute {name!r}")
