"""``--model-impl``: which implementation runs a checkpoint (vLLM's flag).

``native`` is the reference model (:mod:`graphrunner_ref.model`), ``transformers``
the checkpoint's own transformers modules through the bridge
(:mod:`graphrunner_ref.bridge`), ``auto`` the native model where it supports
the checkpoint, else the bridge (said on stderr, with the reason).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from graphrunner_ref.cli.common import UsageError
from graphrunner_ref.io import read_config
from graphrunner_ref.io.safetensors_files import read_json
from graphrunner_ref.model import ModelConfig, UnsupportedModelError

__all__ = ["MODEL_IMPLS", "add_argument", "bridge_config", "resolve"]

MODEL_IMPLS = ("auto", "native", "transformers")


def add_argument(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--model-impl",
        choices=MODEL_IMPLS,
        default="auto",
        help="native (the reference Llama), transformers (any transformers *ForCausalLM "
        "decoder through graphrunner's attention and pools) or auto (native where it "
        "supports the checkpoint, else transformers)",
    )


def resolve(args: argparse.Namespace) -> str:
    """``native`` or ``transformers`` for ``args``' model (``args.model_impl``
    is set to it, so the decision and its note are made once)."""
    impl: str = getattr(args, "model_impl", "auto")
    if args.checkpoint is None:
        if impl == "transformers":
            raise UsageError(
                "--model-impl transformers: needs a checkpoint (--model DIR); the embedded "
                "models run natively"
            )
        return "native"
    if impl != "auto":
        return impl
    try:
        read_config(args.checkpoint)
        impl = "native"
    except UnsupportedModelError as e:
        print(
            f"graphrunner: {args.checkpoint_flag} {args.checkpoint}: not the native model "
            f"({e}); running it through the transformers bridge (--model-impl transformers)",
            file=sys.stderr,
        )
        impl = "transformers"
    args.model_impl = impl
    return impl


def bridge_config(path: Any) -> ModelConfig:
    """The shape of a transformers checkpoint as the command line's checks read
    it (vocabulary, context, the sizes its memory estimate counts)."""
    hf = read_json(path / "config.json")
    text = hf.get("text_config") or hf
    try:
        heads = int(text["num_attention_heads"])
        return ModelConfig(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size") or 4 * text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or 0),
            max_position_embeddings=int(text.get("max_position_embeddings") or 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(
            f"{path}: config.json is not a decoder's ({e}); the transformers bridge needs "
            "vocab_size, hidden_size, num_hidden_layers and num_attention_heads"
        ) from None
