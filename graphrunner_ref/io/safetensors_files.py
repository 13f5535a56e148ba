"""Safetensors checkpoint files: the whole model's tensors, or one
tensor-parallel rank's slices.

Weights may be one ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. A rank reads only its slices
(:func:`read_rank_weights`): safetensors maps the file and copies just the
rows or columns asked for, so each rank's reads and memory are its share.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from graphrunner_ref.model.config import CheckpointError, ModelConfig
from graphrunner_ref.model.parallel import TensorParallel, pad_vocab_shard, shard_slice

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

__all__ = [
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "read_json",
    "read_rank_weights",
    "read_shapes",
    "read_weights",
    "weight_files",
]


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


def weight_files(path: str | Path) -> tuple[list[Path], set[str] | None]:
    """The safetensors files of checkpoint directory ``path``, and the tensor
    names its index lists (None for a single ``model.safetensors``)."""
    root = Path(path)
    if (root / WEIGHTS_FILE).is_file():
        return [root / WEIGHTS_FILE], None
    if not (root / INDEX_FILE).is_file():
        raise CheckpointError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {root}")
    weight_map = read_json(root / INDEX_FILE).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{root / INDEX_FILE}: expected a non-empty 'weight_map' object")
    files = []
    for shard in sorted({_shard_name(root, name, value) for name, value in weight_map.items()}):
        if not (root / shard).is_file():
            raise CheckpointError(f"shard {shard!r} listed in {INDEX_FILE} is missing from {root}")
        files.append(root / shard)
    return files, set(weight_map)


def _check_listed(listed: set[str] | None, found: set[str]) -> None:
    missing = sorted((listed or set()) - found)
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} is listed in {INDEX_FILE} but in no shard")


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint directory ``path``, on the CPU, by name."""
    files, listed = weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(_load_file(file))
    _check_listed(listed, set(tensors))
    return tensors


def read_shapes(path: str | Path) -> dict[str, torch.Size]:
    """Every tensor's shape in checkpoint directory ``path``, from the file
    headers (no tensor data read)."""
    files, listed = weight_files(path)
    shapes = {}
    for file in files:
        with _opened(file) as f:
            names: list[str] = f.keys()
            shapes.update({name: torch.Size(f.get_slice(name).get_shape()) for name in names})
    _check_listed(listed, set(shapes))
    return shapes


def read_rank_weights(
    path: str | Path, config: ModelConfig, tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """Rank ``tp.rank``'s slices (:func:`~graphrunner_ref.model.parallel.shard_slice`)
    of checkpoint directory ``path``'s tensors, on the CPU, by name; only those
    slices are read. Shapes must be checked first (:func:`read_shapes`)."""
    files, listed = weight_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with _opened(file) as f:
            names: list[str] = f.keys()
            for name in names:
                where = shard_slice(name, config, tp)
                if where is None:
                    tensors[name] = f.get_tensor(name)
                    continue
                dim, start, n = where
                part = f.get_slice(name)
                piece = part[start : start + n] if dim == 0 else part[:, start : start + n]
                tensors[name] = pad_vocab_shard(name, piece, config, tp)
    _check_listed(listed, set(tensors))
    return tensors


@contextmanager
def _opened(file: Path) -> Iterator[Any]:
    """``safe_open(file)``, a corrupt file raised as :class:`CheckpointError`."""
    try:
        handle = safe_open(file, framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{file} is not a valid safetensors file: {e}") from None
    with handle as f:
        yield f


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except SafetensorError as e:  # truncated or corrupt: not a ValueError of its own
        raise CheckpointError(f"{file} is not a valid safetensors file: {e}") from None


def read_json(file: Path) -> dict[str, Any]:
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
