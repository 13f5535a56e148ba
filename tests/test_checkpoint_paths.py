"""A sharded checkpoint's index names files inside its folder, and only those:
an entry that leaves the folder, or is not a string, is one CheckpointError
naming the entry, and nothing outside is read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from graphrunner_ref.io import read_weights
from graphrunner_ref.model import CheckpointError


def _sharded(root: Path, weight_map: dict[str, object]) -> Path:
    root.mkdir(parents=True)
    save_file({"a": torch.zeros(2)}, str(root / "model-1.safetensors"))
    index = {"metadata": {}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root


def test_a_plain_shard_name_loads(tmp_path: Path) -> None:
    root = _sharded(tmp_path / "ckpt", {"a": "model-1.safetensors"})
    assert torch.equal(read_weights(root)["a"], torch.zeros(2))


@pytest.mark.parametrize(
    "shard",
    [
        "../outside.safetensors",
        "../../outside.safetensors",
        "sub/model-1.safetensors",
        "/etc/passwd",
        "..",
        "",
    ],
)
def test_a_shard_outside_the_folder_is_refused_by_name(tmp_path: Path, shard: str) -> None:
    save_file({"b": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    root = _sharded(tmp_path / "ckpt", {"a": "model-1.safetensors", "b": shard})
    with pytest.raises(
        CheckpointError, match=r"weight_map\['b'\] = .*inside the checkpoint folder"
    ):
        read_weights(root)


@pytest.mark.parametrize("shard", [3, None, ["model-1.safetensors"]])
def test_a_shard_that_is_not_a_string_is_refused_by_name(tmp_path: Path, shard: object) -> None:
    root = _sharded(tmp_path / "ckpt", {"a": shard})
    with pytest.raises(CheckpointError, match=r"weight_map\['a'\] = .*expected a shard file name"):
        read_weights(root)


def test_a_config_larger_than_its_weights_is_refused_before_the_model_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A vocabulary of 4M and 20,000 layers over the weights of a tiny model:
    # refused from the weights' names and shapes, nothing allocated for the claim.
    from graphrunner_ref.io import checkpoint, save_checkpoint
    from graphrunner_ref.model import default_model

    bundle = default_model(max_requests=2, max_context_len=16)
    save_checkpoint(bundle.model, tmp_path / "ckpt")
    config_file = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_file.read_text())

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before its weights were checked")

    monkeypatch.setattr(checkpoint, "build_model", never)
    for key, value, message in [
        (
            "vocab_size",
            4_000_000,
            r"model.embed_tokens.weight' has shape \(256, 64\): expected \(4000000, 64\)",
        ),
        (
            "num_hidden_layers",
            20_000,
            r"missing tensor 'model.layers.2.* \(19998 of 20000 layers missing\)",
        ),
    ]:
        config_file.write_text(json.dumps({**config, key: value}))
        with pytest.raises(CheckpointError, match=message):
            checkpoint.load_model(tmp_path / "ckpt", max_requests=2, max_context_len=16)


@pytest.mark.parametrize("save", ["save_tiny_mamba", "save_tiny_jamba"])
def test_a_state_space_config_larger_than_its_weights_is_refused_before_allocating(
    tmp_path: Path, save: str
) -> None:
    # A vocabulary of 10**9 would ask the allocator for 100s of GB; the
    # shapes are checked on the meta device first.
    import hf_ssm
    from graphrunner_ref.io import load_any

    getattr(hf_ssm, save)(tmp_path / "ckpt")
    config_file = tmp_path / "ckpt" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "vocab_size": 10**9}))
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{tmp_path / 'ckpt'}: tensor ")
        + r"'.*' has shape \(\d+, \d+\): expected \(1000000000, \d+\)",
    ):
        load_any(tmp_path / "ckpt", max_requests=2, max_context_len=16)
