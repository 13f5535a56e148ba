"""Hostile-inputs table, model files: GGUF files, checkpoints, tokenizers and
chat templates (the builders and cases are the existing tests' own)."""

from __future__ import annotations

import json
import shutil
from functools import partial
from typing import Any

import pytest
import test_checkpoint_paths
import torch
from hostile_table import Case, Outcome, World, api_outcome, both, cli_outcome, environ
from safetensors.torch import save_file
from test_chat_template import HOSTILE_TEMPLATES, TIMED_TEMPLATE, TOKENS, USER
from test_remote_code import remote_code_checkpoint

import hf_ssm
from graphrunner_ref.io import checkpoint, load_any, read_config, read_weights
from graphrunner_ref.io.chat_template import render_chat
from graphrunner_ref.io.gguf_cache import CACHE_ENV
from graphrunner_ref.io.gguf_import import convert_gguf
from graphrunner_ref.io.text import TextCodec
from test_cli import _checkpoint
from test_gguf_hostile import CASES as GGUF_CASES
from test_gguf_hostile import write

__all__ = ["model_file_cases"]

EAGER = ["--runner", "eager", "--capture-sizes", "1,2", "--max-new-tokens", "16"]


def _gguf(kwargs: dict[str, Any], w: World) -> Outcome:
    folder = w.dir("gguf")
    path = write(folder / "bad.gguf", **kwargs)
    out = folder / "out"
    argv = ["convert", "--gguf", str(path), "--out", str(out)]
    outcome = both(lambda: convert_gguf(path, out), argv)
    assert sorted(p.name for p in folder.iterdir()) == ["bad.gguf"], "convert wrote something"
    return outcome


def _gguf_checkpoint(w: World) -> Outcome:
    folder = w.dir("gguf-checkpoint")
    path = write(folder / "bad.gguf", meta={"attention.head_count": 0})
    with environ(CACHE_ENV, str(folder / "cache")):
        outcome = cli_outcome(["generate", "--checkpoint", str(path), *EAGER, "--prompts",
                               str(w.prompts)])  # fmt: skip
    entries = list((folder / "cache" / "checkpoints").glob("gguf-*"))
    assert entries == [], "a cache entry was written"
    return outcome


def _shard(shard: object, w: World) -> Outcome:
    folder = w.dir("shard")
    save_file({"b": torch.ones(2)}, str(folder / "outside.safetensors"))
    root = test_checkpoint_paths._sharded(folder / "ckpt", {"a": "model-1.safetensors", "b": shard})
    return api_outcome(lambda: read_weights(root))


def _config_claim(key: str, value: int, w: World) -> Outcome:
    path = _checkpoint(w.dir("claim"), **{key: value})

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built before its weights were checked")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(checkpoint, "build_model", never)
        return api_outcome(lambda: checkpoint.load_model(path, max_requests=2, max_context_len=16))


def _ssm_vocab(save: str, w: World) -> Outcome:
    path = w.dir("ssm") / "ckpt"
    getattr(hf_ssm, save)(path)
    config_file = path / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "vocab_size": 10**9}))
    return api_outcome(lambda: load_any(path, max_requests=2, max_context_len=16))


def _corrupt_weights(w: World) -> Outcome:
    path = _checkpoint(w.dir("corrupt"))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])
    return cli_outcome(["generate", "--prompts", str(w.prompts), "--checkpoint", str(path), *EAGER])


def _config_value(edit: dict[str, Any], w: World) -> Outcome:
    path = _checkpoint(w.dir("config"), **edit)
    return cli_outcome(["generate", "--prompts", str(w.prompts), "--checkpoint", str(path), *EAGER])


def _remote_code(w: World) -> Outcome:
    path = remote_code_checkpoint(w.dir("remote") / "hf")
    outcome = api_outcome(lambda: TextCodec.load(path, what="--prompt"))
    assert not (path / "RAN").exists(), "the checkpoint's own Python ran"
    return outcome


def _oversized_api(w: World) -> Outcome:
    _, oversized = w.text_checkpoints
    vocab = read_config(oversized).vocab_size
    return api_outcome(lambda: TextCodec.load(oversized, what="--prompt", vocab_size=vocab))


def _oversized_cli(w: World) -> Outcome:
    _, oversized = w.text_checkpoints
    return cli_outcome(["generate", "--checkpoint", str(oversized), *EAGER, "--prompt", "hi"])


def _template(template: str, w: World) -> Outcome:
    return api_outcome(lambda: render_chat(template, USER, TOKENS))


def _chat_cli(w: World) -> Outcome:
    text, _ = w.text_checkpoints
    path = w.dir("chat") / "hf"
    shutil.copytree(text, path)
    (path / "chat_template.jinja").write_text("{{ 'a' * 10**8 }}")
    return cli_outcome(["generate", "--checkpoint", str(path), *EAGER, "--chat", "--prompt", "hi"])


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def model_file_cases() -> list[Case]:
    convert = "graphrunner convert --gguf bad.gguf --out DIR"
    generate = "graphrunner generate --checkpoint DIR --prompts FILE"
    cases = [
        Case("GGUF files", name, convert, partial(_gguf, kwargs), r"exit 2 \(GGUFImportError\)",
             message)
        for name, (kwargs, message) in GGUF_CASES.items()
    ]  # fmt: skip
    cases.append(
        Case("GGUF files", "head_count 0, given as --checkpoint (cache conversion)",
             "graphrunner generate --checkpoint bad.gguf", _gguf_checkpoint, "exit 2",
             r"bad.gguf: GGUF llama.attention.head_count=0: expected an int >= 1")
    )  # fmt: skip
    for shard in ["../outside.safetensors", "../../outside.safetensors",
                  "sub/model-1.safetensors", "/etc/passwd", "..", ""]:  # fmt: skip
        cases.append(Case("Checkpoints", f"shard index entry {shard!r}", "read_weights(DIR)",
                          partial(_shard, shard), "CheckpointError",
                          r"weight_map\['b'\] = .*inside the checkpoint folder"))  # fmt: skip
    for shard in [3, None, ["model-1.safetensors"]]:
        cases.append(Case("Checkpoints", f"shard index entry {shard!r} (not a string)",
                          "read_weights(DIR)", partial(_shard, shard), "CheckpointError",
                          r"expected a shard file name"))  # fmt: skip
    cases += [
        Case("Checkpoints", "config vocab_size 4M over a vocab-256 model's weights",
             "load_model(DIR, ...)", partial(_config_claim, "vocab_size", 4_000_000),
             "WeightError", r"expected \(4000000, 64\)"),
        Case("Checkpoints", "config num_hidden_layers 20,000 over 2 layers of weights",
             "load_model(DIR, ...)", partial(_config_claim, "num_hidden_layers", 20_000),
             "WeightError", r"19998 of 20000 layers missing"),
        Case("Checkpoints", "Mamba config vocab_size 10**9", "load_any(DIR, ...)",
             partial(_ssm_vocab, "save_tiny_mamba"), "WeightError",
             r"ckpt: tensor .* expected \(1000000000, \d+\)"),
        Case("Checkpoints", "Jamba (hybrid) config vocab_size 10**9", "load_any(DIR, ...)",
             partial(_ssm_vocab, "save_tiny_jamba"), "WeightError",
             r"ckpt: tensor .* expected \(1000000000, \d+\)"),
        Case("Checkpoints", "model.safetensors cut to 300 bytes", generate, _corrupt_weights,
             "exit 2", r"is not a valid safetensors file"),
        Case("Checkpoints", "config head_dim 16.0", generate,
             partial(_config_value, {"head_dim": 16.0}), "exit 2",
             r"head_dim=16.0: expected a positive int"),
        Case("Checkpoints", "config rms_norm_eps null", generate,
             partial(_config_value, {"rms_norm_eps": None}), "exit 2",
             r"rms_norm_eps=None: expected a positive finite number"),
        Case("Tokenizers", "auto_map to the checkpoint's own Python (never run, never asked)",
             "TextCodec.load(DIR, what=...)", _remote_code, "NoTokenizerError",
             r"tokenizer_config.json maps its tokenizer to code in the checkpoint"),
        Case("Tokenizers", "tokenizer larger than the model's vocabulary",
             "TextCodec.load(DIR, what=..., vocab_size=256)", _oversized_api,
             "TokenizerVocabError", r"more than the model's vocab_size 256"),
        Case("Tokenizers", "tokenizer larger than the model's vocabulary",
             "graphrunner generate --checkpoint DIR --prompt hi", _oversized_cli, "exit 2",
             r"more than the model's vocab_size 256"),
        Case("Tokenizers", "text for a model without a tokenizer",
             "graphrunner generate --prompt hi",
             lambda w: cli_outcome(["generate", *EAGER, "--prompt", "hi"]), "exit 2",
             r"--prompt needs a tokenizer: the embedded random model has none"),
    ]  # fmt: skip
    for template, message in [*HOSTILE_TEMPLATES, (TIMED_TEMPLATE, "longer than")]:
        cases.append(Case("Chat templates", _short(template), "render_chat(TEMPLATE, ...)",
                          partial(_template, template), "ChatTemplateError", message))  # fmt: skip
    cases.append(
        Case("Chat templates", "{{ 'a' * 10**8 }} in a checkpoint, with --chat",
             "graphrunner generate --checkpoint DIR --chat --prompt hi", _chat_cli, "exit 2",
             r"--chat: the checkpoint's chat template: a value")
    )  # fmt: skip
    return cases
