"""Load and save Hugging Face-layout checkpoints: ``config.json`` + safetensors.

Weights may be one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``; tensor names are those transformers'
``LlamaForCausalLM`` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from graphrunner_ref.io.mamba_checkpoint import (
    StateSpaceBundle,
    load_state_space_model,
    parse_config,
    state_space_type,
)
from graphrunner_ref.io.safetensors_files import (
    WEIGHTS_FILE,
    read_json,
    read_rank_weights,
    read_shapes,
    read_weights,
)
from graphrunner_ref.model.build import ModelBundle, build_model
from graphrunner_ref.model.config import ModelConfig
from graphrunner_ref.model.hybrid_config import HybridConfig
from graphrunner_ref.model.llama import LlamaDecoder, is_derived
from graphrunner_ref.model.mamba import MambaConfig
from graphrunner_ref.model.parallel import SINGLE, TensorParallel
from graphrunner_ref.model.shapes import check_llama_weights

CONFIG_FILE = "config.json"


def read_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of checkpoint directory ``path``."""
    return ModelConfig.from_hf_dict(read_json(Path(path) / CONFIG_FILE))


def load_model(
    path: str | Path,
    *,
    max_requests: int,
    max_context_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
    tp: TensorParallel = SINGLE,
    kv_dtype: torch.dtype | None = None,
) -> ModelBundle:
    """Read checkpoint ``path`` and build a model over fresh pools (see
    :func:`build_model`, ``kv_dtype`` the KV cache's).

    With ``tp.world > 1``: rank ``tp.rank``'s shard, which reads only its
    slices of the safetensors files (the shapes checked first, from the headers).

    Raises :class:`CheckpointError` (or a subclass) naming the missing file,
    the unsupported architecture or field, or the first bad tensor. A ``.gguf``
    file is converted once into the cache (:mod:`graphrunner_ref.io.gguf_cache`).
    """
    path = resolve_checkpoint(path)
    config = read_config(path)
    # Before allocating anything: fail fast on a bad file.
    weights = read_weights(path) if tp.world == 1 else None
    shapes = read_shapes(path) if weights is None else {k: v.shape for k, v in weights.items()}
    check_llama_weights(_as_loaded(shapes, config), config, str(path))
    bundle = build_model(
        config,
        max_requests=max_requests,
        max_context_len=max_context_len,
        device=device,
        dtype=dtype,
        page_size=page_size,
        tp=tp,
        kv_dtype=kv_dtype,
    )
    bundle.model.load_weights(read_rank_weights(path, config, tp) if weights is None else weights)
    return bundle


def _as_loaded(shapes: dict[str, torch.Size], config: ModelConfig) -> dict[str, torch.Size]:
    """The shapes :meth:`LlamaDecoder.load_weights` will check, by name: the
    derived rotary frequencies and a tied head (compared to the embedding
    there) left out."""
    skip = "lm_head.weight" if config.tie_word_embeddings else None
    return {name: s for name, s in shapes.items() if not is_derived(name) and name != skip}


def resolve_checkpoint(path: str | Path) -> Path:
    """The one GGUF entry point: a ``.gguf`` file becomes its converted directory
    in the cache (converted once, :mod:`graphrunner_ref.io.gguf_cache`); any other
    path is returned as it is."""
    from graphrunner_ref.io.gguf_cache import checkpoint_dir

    return checkpoint_dir(Path(path))


def state_space_kind(path: str | Path) -> str | None:
    """``"mamba"``, ``"mamba2"``, ``"jamba"`` or ``"bamba"`` when checkpoint
    directory ``path`` holds such a model (by ``model_type`` or
    ``architectures``), else None (a Llama, or a ``.gguf`` file: the only
    architecture GGUF import reads). Raises :class:`CheckpointError` when its
    ``config.json`` is missing or not a JSON object."""
    root = Path(path)
    if root.suffix.lower() == ".gguf" and not root.is_dir():
        return None
    return state_space_type(read_json(root / CONFIG_FILE))


def read_any_config(path: str | Path) -> ModelConfig | MambaConfig | HybridConfig:
    """The config of checkpoint ``path`` of any supported kind (a ``.gguf`` file
    is converted first): :class:`ModelConfig` for a Llama, the Mamba or hybrid
    config for a state-space model."""
    root = resolve_checkpoint(path)
    hf = read_json(root / CONFIG_FILE)
    if state_space_type(hf) is not None:
        return parse_config(hf)
    return ModelConfig.from_hf_dict(hf)


def load_any(
    path: str | Path,
    *,
    max_requests: int,
    max_context_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
    tp: TensorParallel = SINGLE,
    kv_dtype: torch.dtype | None = None,
) -> ModelBundle | StateSpaceBundle:
    """The one checkpoint dispatcher: a ``.gguf`` file through
    :func:`resolve_checkpoint`, then by ``config.json`` a Mamba / Jamba / Bamba
    model as a :class:`StateSpaceBundle` over a hybrid request pool, else a
    Llama as :func:`load_model` builds it. The CLI and the library both load
    through here. ``tp``: a Llama's tensor-parallel shard (see :func:`load_model`);
    a state-space model is not sharded (``ValueError`` with ``tp.world > 1``).
    ``kv_dtype``: a Llama's KV cache dtype (:func:`build_model`); a state-space
    model's is its own dtype (``ValueError`` for another)."""
    root = resolve_checkpoint(path)
    hf = read_json(root / CONFIG_FILE)
    if state_space_type(hf) is not None:
        if tp.world > 1:
            raise ValueError(
                f"tp.world={tp.world}: {root} holds a {state_space_type(hf)} model, which "
                "is not sharded; expected tp.world=1"
            )
        if kv_dtype not in (None, dtype):
            raise ValueError(
                f"kv_dtype={str(kv_dtype).removeprefix('torch.')}: {root} holds a "
                f"{state_space_type(hf)} model, whose KV cache is in the model's dtype"
            )
        return load_state_space_model(
            hf,
            read_weights(root),
            max_requests=max_requests,
            max_context_len=max_context_len,
            device=device,
            dtype=dtype,
            page_size=page_size,
            where=str(root),
        )
    return load_model(
        root,
        max_requests=max_requests,
        max_context_len=max_context_len,
        device=device,
        dtype=dtype,
        page_size=page_size,
        tp=tp,
        kv_dtype=kv_dtype,
    )


#: The earlier name of :func:`load_any`, kept.
load_any_model = load_any


def save_checkpoint(model: LlamaDecoder, path: str | Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` as transformers would."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, root / WEIGHTS_FILE, metadata={"format": "pt"})
