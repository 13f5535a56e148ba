"""GGUF import: a Llama-architecture ``.gguf`` file to the Hugging Face layout.

Read with the ``gguf`` package (its reader and its dequantisation): the
metadata gives ``config.json``, every tensor is dequantised to float32 and
renamed to transformers' ``LlamaForCausalLM`` names, and the tokenizer
metadata becomes ``tokenizer.json`` / ``tokenizer_config.json``
(:mod:`graphrunner_ref.io.gguf_tokenizer`).

llama.cpp stores the query and key projections with the rows of each head
interleaved for its rotary kernel (the first half of a head's rows and the
second half alternate); :func:`unpermute_qk` undoes that, so the converted
weights are those of the Hugging Face checkpoint the GGUF was made from.

Everything is written to a temporary directory beside ``out`` and renamed
into place at the end: an error or SIGTERM leaves nothing behind, and the
temporary a SIGKILLed conversion left is removed by the next conversion into
the same ``out`` (:mod:`graphrunner.util.temp`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from graphrunner.util import needs_extra, remove_stale_temps, temp_path
from graphrunner_ref.io.gguf_meta import GGUFImportError, field, open_gguf
from graphrunner_ref.io.gguf_tokenizer import write_tokenizer
from graphrunner_ref.model.config import CheckpointError, ModelConfig
from graphrunner_ref.model.shapes import check_llama_weights

__all__ = [
    "SUPPORTED_TYPES",
    "GGUFImportError",
    "check_gguf_tensors",
    "convert_gguf",
    "gguf_config",
    "hf_tensor_name",
    "open_gguf",
    "read_gguf_weights",
    "unpermute_qk",
]

#: Tensor types dequantised on import (``gguf.GGMLQuantizationType`` names):
#: plain floats, the legacy block types and the k-quants.
SUPPORTED_TYPES = frozenset(
    ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
    + ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
)

# GGUF per-layer tensor kinds (blk.{i}.{kind}.weight) -> transformers' module names.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_config(reader: Any) -> dict[str, Any]:
    """The ``config.json`` dict of a Llama GGUF; :class:`GGUFImportError` names
    an unsupported architecture, RoPE variant or missing field."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"GGUF architecture {arch!r} is not supported; expected 'llama'")

    def need(key: str, lo: int = 1) -> int:
        value = field(reader, f"llama.{key}")
        if value is None:
            raise GGUFImportError(f"GGUF metadata is missing llama.{key}")
        return _int(f"llama.{key}", value, lo)

    def optional(key: str, default: int) -> int:
        return _int(f"llama.{key}", field(reader, f"llama.{key}", default), 1)

    scaling = field(reader, "llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFImportError(
            f"GGUF llama.rope.scaling.type={scaling!r} is not supported; expected none"
        )
    heads, hidden = need("attention.head_count"), need("embedding_length")
    if field(reader, "llama.attention.key_length") is None and hidden % heads:
        raise GGUFImportError(
            f"GGUF llama.embedding_length={hidden} does not split into "
            f"llama.attention.head_count={heads} heads"
        )
    head_dim = optional("attention.key_length", hidden // heads)
    rope_dims = optional("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise GGUFImportError(
            f"GGUF llama.rope.dimension_count={rope_dims} is not supported; "
            f"expected the head size {head_dim} (partial rotary)"
        )
    names = {t.name for t in reader.tensors}
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise GGUFImportError("GGUF has no tensor 'token_embd.weight'")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(embed.shape[1]),  # ggml order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": optional("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float(reader, "llama.attention.layer_norm_rms_epsilon", None),
        "rope_theta": _float(reader, "llama.rope.freq_base", 10000.0),
        "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[ours] = _int(f"tokenizer.ggml.{key}", value, 0)
    try:
        ModelConfig.from_hf_dict(config)  # the executor's own checks, before any tensor
    except CheckpointError as e:
        raise GGUFImportError(f"GGUF metadata: {e}") from None
    return config


def _int(key: str, value: object, lo: int) -> int:
    """A metadata value that must be an int >= ``lo`` (never a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < lo:
        raise GGUFImportError(f"GGUF {key}={value!r}: expected an int >= {lo}")
    return int(value)


def _float(reader: Any, key: str, default: float | None) -> float:
    value = field(reader, key, default)
    if value is None:
        raise GGUFImportError(f"GGUF metadata is missing {key}")
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise GGUFImportError(f"GGUF {key}={value!r}: expected a number")
    return float(value)


def unpermute_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row order of a ``[heads * head_dim, in]`` projection:
    within each head, GGUF row ``2j + p`` is Hugging Face row ``p * head_dim / 2 + j``."""
    out, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(heads, out // heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def hf_tensor_name(name: str, blocks: int | None) -> str:
    """The transformers name of GGUF tensor ``name`` (``blk.3.ffn_up.weight`` ->
    ``model.layers.3.mlp.up_proj.weight``); :class:`GGUFImportError` names a
    tensor outside a Llama model or a block past ``blocks``."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in _LAYER_NAMES:
        if not parts[1].isdigit() or (blocks is not None and int(parts[1]) >= blocks):
            expected = "a block number" if blocks is None else f"0..{blocks - 1}"
            raise GGUFImportError(
                f"GGUF tensor {name!r} names block {parts[1]!r}: expected {expected} "
                f"(llama.block_count={blocks})"
            )
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    raise GGUFImportError(f"GGUF tensor {name!r} is not part of a Llama model")


def _check_type(tensor: Any) -> None:
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise GGUFImportError(
            f"GGUF tensor {tensor.name!r} has type {kind}, which is not supported; "
            f"expected one of {', '.join(sorted(SUPPORTED_TYPES))}"
        )


def check_gguf_tensors(reader: Any, config: dict[str, Any]) -> None:
    """Every tensor's type, name and shape against the config, before any is
    read: a GGUF that converts also loads. :class:`GGUFImportError` names the
    first tensor missing, unexpected, misshapen or of an unsupported type."""
    blocks = config["num_hidden_layers"]
    given: dict[str, list[int]] = {}
    for t in reader.tensors:
        _check_type(t)
        # ggml's shape lists the fastest dimension first: torch's is the reverse.
        given[hf_tensor_name(t.name, blocks)] = [int(n) for n in reversed(t.shape)]
    try:
        check_llama_weights(given, ModelConfig.from_hf_dict(config), "GGUF")
    except CheckpointError as e:
        raise GGUFImportError(str(e)) from None


def read_gguf_weights(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32 under its transformers name, Q and K
    projections back in Hugging Face row order. Types and names are checked
    for all tensors before any is dequantised (:func:`convert_gguf` checks
    shapes against the whole config first, :func:`check_gguf_tensors`)."""
    with needs_extra("gguf", "GGUF import"):
        import gguf

    blocks = config.get("num_hidden_layers")
    for t in reader.tensors:
        _check_type(t)
        hf_tensor_name(t.name, blocks)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # a short data block in a truncated file
            raise GGUFImportError(f"GGUF tensor {t.name!r} cannot be read: {e}") from None
        shape = [int(n) for n in reversed(t.shape)]  # checked above
        # np.array copies: the reader's memory map is read-only.
        weight = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if kind in heads:
            weight = unpermute_qk(weight, heads[kind])
        tensors[hf_tensor_name(t.name, blocks)] = weight.contiguous()
    return tensors


def convert_gguf(path: str | Path, out: str | Path) -> Path:
    """Write the Hugging Face layout of GGUF ``path`` into new directory ``out``
    (``config.json``, ``model.safetensors``, tokenizer files when the GGUF's
    tokenizer is one :mod:`graphrunner_ref.io.gguf_tokenizer` builds). ``out`` must
    not exist or be empty. Returns ``out``. Temporaries that killed
    conversions into ``out`` left are removed first.
    """
    dest = Path(out)
    remove_stale_temps(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise GGUFImportError(f"--out {dest}: exists and is not an empty directory")
    reader = open_gguf(path)
    config = gguf_config(reader)
    check_gguf_tensors(reader, config)
    weights = read_gguf_weights(reader, config)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dest)
    try:
        tmp.mkdir()
        write_tokenizer(
            reader, tmp, context=config["max_position_embeddings"], vocab_size=config["vocab_size"]
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        if dest.exists():
            dest.rmdir()  # empty, checked above
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
