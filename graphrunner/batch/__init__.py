"""The decode batch: live rows with their host mirrors, validated once when
sealed, filtered and merged by the scheduler."""

from __future__ import annotations

from graphrunner.batch.decode_batch import BatchError, DecodeBatch

__all__ = ["BatchError", "DecodeBatch"]
