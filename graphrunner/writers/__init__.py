"""Populate: the one routine that copies live rows into the static buffers and
applies each declared pad rule to the padded tail. Writers: grouped torch ops
(:class:`TorchWriter`), one fused Triton launch (:class:`FusedPopulate`), or
inside the captured step (:class:`InGraphPopulate`)."""

from __future__ import annotations

from graphrunner.writers.base import PopulateError, TorchWriter, populate
from graphrunner.writers.fused import FusedPopulate, InGraphPopulate

__all__ = ["FusedPopulate", "InGraphPopulate", "PopulateError", "TorchWriter", "populate"]
