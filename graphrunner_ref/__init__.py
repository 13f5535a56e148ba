"""graphrunner_ref: the reference engine built on graphrunner's public API.

A Llama-style model and Mamba / hybrid models over graphrunner's pools,
checkpoint and GGUF I/O, an engine loop (plain, overlap, multi-step and
speculative schedules), a model registry (a kind of model recognises, loads
and steps its checkpoints: :func:`register` adds one) and the ``graphrunner``
command line. It imports the library only through public names
(``graphrunner`` and its subpackages' ``__all__``; a test holds it), so
whatever this engine does, an engine of one's own can do too.
"""

from __future__ import annotations

from graphrunner_ref.engine.bundle import create_decode_runner
from graphrunner_ref.engine.config import EngineConfig
from graphrunner_ref.engine.loop import Engine, EngineResult
from graphrunner_ref.engine.registry import DecodeStep, ModelKind, register, unregister
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
    "DecodeStep",
    "Engine",
    "EngineConfig",
    "EngineResult",
    "MambaConfig",
    "MixerShape",
    "ModelBundle",
    "ModelKind",
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
    "register",
    "save_checkpoint",
    "unregister",
]
