"""graphrunner: capture decode steps as graphs at fixed batch sizes, replay them padded, safely."""

from __future__ import annotations

__all__: list[str] = []
