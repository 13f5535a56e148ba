"""Any transformers decoder over graphrunner's pools: the model's own modules,
graphrunner's paged attention (slot 0 reserved, the declared pad rules),
captured and replayed padded by every runner. See :mod:`.decoder`."""

from __future__ import annotations

from graphrunner_ref.bridge.attention import ATTENTION, StepKV, paged_attention
from graphrunner_ref.bridge.decoder import (
    TransformersBundle,
    TransformersDecoder,
    build_transformers_bundle,
    load_transformers,
)
from graphrunner_ref.bridge.quantize import quantize_linears

__all__ = [
    "ATTENTION",
    "StepKV",
    "TransformersBundle",
    "TransformersDecoder",
    "build_transformers_bundle",
    "load_transformers",
    "paged_attention",
    "quantize_linears",
]
