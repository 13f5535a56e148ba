"""graphrunner_ref: the reference engine built on graphrunner's public API.

A Llama-style model and Mamba / hybrid models over graphrunner's pools,
checkpoint and GGUF I/O, an engine loop (plain, overlap, multi-step and
speculative schedules) and the ``graphrunner`` command line. It imports the
library only through public names (``graphrunner`` and its subpackages'
``__all__``; a test holds it), so whatever this engine does, an engine of
one's own can do too.
"""

from __future__ import annotations

from graphrunner_ref.engine.bundle import create_decode_runner
from graphrunner_ref.engine.loop import Engine, EngineResult
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.io import load_any, load_model, read_config, save_checkpoint
from graphrunner_ref.io.mamba_checkpoint import build_state_space_model
from graphrunner_ref.model import ModelBundle, ModelConfig, build_model, default_model
from graphrunner_ref.model.mamba import MambaConfig
from graphrunner_ref.model.mamba_mixer import MixerShape
from graphrunner_ref.model.parallel import TensorParallel
from graphrunner_ref.model.quantize import QUANTIZATIONS, quantize_model

__all__ = [
    "QUANTIZATIONS",
    "Engine",
    "EngineResult",
    "MambaConfig",
    "MixerShape",
    "ModelBundle",
    "ModelConfig",
    "Request",
    "TensorParallel",
    "build_model",
    "build_state_space_model",
    "create_decode_runner",
    "default_model",
    "load_any",
    "load_model",
    "quantize_model",
    "read_config",
    "save_checkpoint",
]
