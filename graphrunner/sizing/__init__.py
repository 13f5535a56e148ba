"""Which batch sizes to capture: padding to the next captured size, the
waste it costs, size plans from a histogram of observed batch sizes, and the
capture report."""

from __future__ import annotations

from graphrunner.sizing.histogram import BatchSizeHistogram, HistogramFileError, read_histogram
from graphrunner.sizing.plan import (
    SizePlan,
    budget_capture_sizes,
    expected_waste,
    optimal_capture_sizes,
)
from graphrunner.sizing.report import CaptureReport, RunnerStats, SizeReport
from graphrunner.sizing.report_file import (
    ReportFileError,
    read_capture_report,
    write_capture_report,
)
from graphrunner.sizing.sizes import (
    BatchSizeError,
    PaddingWaste,
    default_capture_sizes,
    pad_to,
    padding_waste,
)

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
    "expected_waste",
    "optimal_capture_sizes",
    "pad_to",
    "padding_waste",
    "read_capture_report",
    "read_histogram",
    "write_capture_report",
]
