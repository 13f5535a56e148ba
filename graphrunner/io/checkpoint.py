"""Load and save Hugging Face-layout checkpoints: ``config.json`` + safetensors.

Weights may be one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``; tensor names are those transformers'
``LlamaForCausalLM`` writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from graphrunner.io.mamba_checkpoint import (
    StateSpaceBundle,
    load_state_space_model,
    parse_config,
    state_space_type,
)
from graphrunner.model.build import ModelBundle, build_model
from graphrunner.model.config import CheckpointError, ModelConfig
from graphrunner.model.hybrid_config import HybridConfig
from graphrunner.model.llama import LlamaDecoder, is_derived
from graphrunner.model.mamba import MambaConfig
from graphrunner.model.shapes import check_llama_weights

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of checkpoint directory ``path``."""
    return ModelConfig.from_hf_dict(_read_json(Path(path) / CONFIG_FILE))


def _shard_name(root: Path, tensor: object, shard: object) -> str:
    """``weight_map[tensor]``, checked: a plain file name inside ``root``, never
    a path that leaves the checkpoint folder."""
    where = f"{root / INDEX_FILE}: weight_map[{tensor!r}]"
    if not isinstance(shard, str):
        raise CheckpointError(f"{where} = {shard!r}; expected a shard file name (a string)")
    plain = shard == Path(shard).name and shard not in {"", ".", ".."} and "\\" not in shard
    if not plain:
        raise CheckpointError(
            f"{where} = {shard!r}; expected a file name inside the checkpoint folder"
        )
    return shard


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint directory ``path``, on the CPU, by name."""
    root = Path(path)
    if (root / WEIGHTS_FILE).is_file():
        return _load_file(root / WEIGHTS_FILE)
    if not (root / INDEX_FILE).is_file():
        raise CheckpointError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {root}")
    weight_map = _read_json(root / INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{root / INDEX_FILE}: expected a non-empty 'weight_map' object")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted({_shard_name(root, name, value) for name, value in weight_map.items()}):
        if not (root / shard).is_file():
            raise CheckpointError(f"shard {shard!r} listed in {INDEX_FILE} is missing from {root}")
        tensors.update(_load_file(root / shard))
    listed_missing = sorted(set(weight_map) - set(tensors))
    if listed_missing:
        raise CheckpointError(
            f"tensor {listed_missing[0]!r} is listed in {INDEX_FILE} but in no shard"
        )
    return tensors


def load_model(
    path: str | Path,
    *,
    max_requests: int,
    max_context_len: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    page_size: int = 1,
) -> ModelBundle:
    """Read checkpoint ``path`` and build a model over fresh pools (see :func:`build_model`).

    Raises :class:`CheckpointError` (or a subclass) naming the missing file,
    the unsupported architecture or field, or the first bad tensor. A ``.gguf``
    file is converted once into the cache (:mod:`graphrunner.io.gguf_cache`).
    """
    path = resolve_checkpoint(path)
    config = read_config(path)
    weights = read_weights(path)  # before allocating anything: fail fast on a bad file
    check_llama_weights(_as_loaded(weights, config), config, str(path))
    bundle = build_model(
        config,
        max_requests=max_requests,
        max_context_len=max_context_len,
        device=device,
        dtype=dtype,
        page_size=page_size,
    )
    bundle.model.load_weights(weights)
    return bundle


def _as_loaded(weights: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Size]:
    """The shapes :meth:`LlamaDecoder.load_weights` will check, by name: the
    derived rotary frequencies and a tied head (compared to the embedding
    there) left out."""
    skip = "lm_head.weight" if config.tie_word_embeddings else None
    return {name: w.shape for name, w in weights.items() if not is_derived(name) and name != skip}


def resolve_checkpoint(path: str | Path) -> Path:
    """The one GGUF entry point: a ``.gguf`` file becomes its converted directory
    in the cache (converted once, :mod:`graphrunner.io.gguf_cache`); any other
    path is returned as it is."""
    from graphrunner.io.gguf_cache import checkpoint_dir

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
    return state_space_type(_read_json(root / CONFIG_FILE))


def read_any_config(path: str | Path) -> ModelConfig | MambaConfig | HybridConfig:
    """The config of checkpoint ``path`` of any supported kind (a ``.gguf`` file
    is converted first): :class:`ModelConfig` for a Llama, the Mamba or hybrid
    config for a state-space model."""
    root = resolve_checkpoint(path)
    hf = _read_json(root / CONFIG_FILE)
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
) -> ModelBundle | StateSpaceBundle:
    """The one checkpoint dispatcher: a ``.gguf`` file through
    :func:`resolve_checkpoint`, then by ``config.json`` a Mamba / Jamba / Bamba
    model as a :class:`StateSpaceBundle` over a hybrid request pool, else a
    Llama as :func:`load_model` builds it. The CLI and the library both load
    through here."""
    root = resolve_checkpoint(path)
    hf = _read_json(root / CONFIG_FILE)
    if state_space_type(hf) is not None:
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


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except SafetensorError as e:  # truncated or corrupt: not a ValueError of its own
        raise CheckpointError(f"{file} is not a valid safetensors file: {e}") from None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"missing {file}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not valid UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data
