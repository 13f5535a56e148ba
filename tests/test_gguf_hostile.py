"""Hostile GGUF files: each ends in one GGUFImportError naming the field or the
tensor, exit 2 on the CLI, nothing written, and nothing the size of the model
allocated first. A GGUF that converts is one that loads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import graphrunner_ref.cli.main as cli
from graphrunner_ref.io import load_model
from graphrunner_ref.io.gguf_import import GGUFImportError, convert_gguf

HIDDEN, INTER, HEADS, KV, LAYERS, VOCAB = 16, 32, 4, 2, 2, 32
HEAD_DIM = HIDDEN // HEADS
META: dict[str, Any] = {
    "block_count": LAYERS,
    "context_length": 64,
    "embedding_length": HIDDEN,
    "feed_forward_length": INTER,
    "attention.head_count": HEADS,
    "attention.head_count_kv": KV,
    "attention.layer_norm_rms_epsilon": 1e-5,
}


def _tensors(layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    per_layer = {
        "attn_norm": (HIDDEN,),
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV * HEAD_DIM, HIDDEN),
        "attn_v": (KV * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_norm": (HIDDEN,),
        "ffn_gate": (INTER, HIDDEN),
        "ffn_up": (INTER, HIDDEN),
        "ffn_down": (HIDDEN, INTER),
    }
    for i in range(layers):
        shapes.update({f"blk.{i}.{k}.weight": s for k, s in per_layer.items()})
    return shapes


def write(
    path: Path,
    *,
    meta: dict[str, Any] | None = None,
    tensors: dict[str, tuple[int, ...]] | None = None,
    tokens: list[str] | None = None,
    merges: list[str] | None = None,
) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    for key, value in {**META, **(meta or {})}.items():
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(f"llama.{key}", value)
        elif isinstance(value, float):
            w.add_float32(f"llama.{key}", value)
        else:
            w.add_uint64(f"llama.{key}", value)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_merges(merges or [])
    rng = np.random.default_rng(0)
    for name, shape in (tensors if tensors is not None else _tensors()).items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _without(name: str) -> dict[str, tuple[int, ...]]:
    return {k: v for k, v in _tensors().items() if k != name}


CASES: dict[str, tuple[dict[str, Any], str]] = {
    "head_count 0": (
        {"meta": {"attention.head_count": 0}},
        r"llama.attention.head_count=0: expected an int >= 1",
    ),
    "block_count a string": (
        {"meta": {"block_count": "two"}},
        r"llama.block_count='two': expected an int >= 1",
    ),
    "hidden not split by heads": (
        {"meta": {"attention.head_count": 3}},
        r"embedding_length=16 does not split into llama.attention.head_count=3",
    ),
    "a tensor named blk.x": (
        {"tensors": {**_tensors(), "blk.x.attn_q.weight": (16, 16)}},
        r"'blk.x.attn_q.weight' names block 'x'",
    ),
    "a block beyond the count": (
        {"tensors": _tensors(layers=3)},
        r"'blk.2.attn_norm.weight' names block '2': expected 0..1",
    ),
    "block_count 10**6 with two blocks": (
        {"meta": {"block_count": 10**6}},
        r"missing tensor 'model.layers.2.self_attn.q_proj.weight' \(999998 of 1000000 layers",
    ),
    "a missing tensor": (
        {"tensors": _without("blk.1.ffn_up.weight")},
        r"missing tensor 'model.layers.1.mlp.up_proj.weight'",
    ),
    "Q rows that do not split into heads": (
        {"tensors": {**_tensors(), "blk.0.attn_q.weight": (HEADS * HEAD_DIM - 2, HIDDEN)}},
        r"'model.layers.0.self_attn.q_proj.weight' has shape \(14, 16\): expected \(16, 16\)",
    ),
    "a shape that disagrees with the metadata": (
        {"tensors": {**_tensors(), "blk.1.ffn_down.weight": (HIDDEN, INTER + 1)}},
        r"'model.layers.1.mlp.down_proj.weight' has shape \(16, 33\): expected \(16, 32\)",
    ),
    "merges naming unknown tokens": (
        {"tokens": ["a", "b"], "merges": ["x y"]},
        r"GGUF tokenizer cannot be built",
    ),
    "more tokens than the vocabulary": (
        {"tokens": [f"t{i}" for i in range(VOCAB + 1)]},
        rf"GGUF tokenizer: {VOCAB + 1} tokens, more than the model's vocabulary of {VOCAB}",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_gguf_is_refused_by_name_and_nothing_is_written(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kwargs, message = CASES[case]
    path = write(tmp_path / "bad.gguf", **kwargs)
    out = tmp_path / "out"
    with pytest.raises(GGUFImportError, match=message):
        convert_gguf(path, out)
    assert cli.main(["convert", "--gguf", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_the_well_formed_twin_converts_and_loads(tmp_path: Path) -> None:
    path = write(tmp_path / "good.gguf")
    out = convert_gguf(path, tmp_path / "out")
    bundle = load_model(out, max_requests=2, max_context_len=16)
    assert bundle.model.config.num_layers == LAYERS


def test_the_shape_table_is_the_models_own() -> None:
    import torch

    from graphrunner_ref.model import ModelConfig, default_model
    from graphrunner_ref.model.shapes import llama_weight_shapes

    for tied in (False, True):
        config = ModelConfig(VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV, tie_word_embeddings=tied)
        bundle = default_model(config=config, max_requests=2, max_context_len=16)
        params = {n: tuple(p.shape) for n, p in bundle.model.named_parameters()}
        assert llama_weight_shapes(config) == params
        assert all(p.dtype == torch.float32 for p in bundle.model.parameters())
