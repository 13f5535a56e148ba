"""Populate: the one routine that copies live rows into the static buffers and
applies each declared pad rule to the padded tail. Writers: grouped torch ops
(:class:`TorchWriter`), one fused Triton launch (:class:`FusedPopulate`), or
inside the captured step (:class:`InGraphPopulate`); the fused two load on
first use (a runner that never fuses never imports the kernel's module)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphrunner.writers.base import PopulateError, TorchWriter, populate

if TYPE_CHECKING:
    from graphrunner.writers.fused import FusedPopulate, InGraphPopulate

__all__ = ["FusedPopulate", "InGraphPopulate", "PopulateError", "TorchWriter", "populate"]


def __getattr__(name: str) -> object:
    if name in ("FusedPopulate", "InGraphPopulate"):
        from graphrunner.writers import fused

        return getattr(fused, name)
    raise AttributeError(f"module 'graphrunner.writers' has no attribute {name!r}")
