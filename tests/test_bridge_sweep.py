"""A sweep of transformers' decoders through the bridge, as a new user runs
them: a tiny random checkpoint of each (transformers' own config class,
shrunk, saved with ``save_pretrained``) through ``generate --model DIR
--model-impl transformers --json --check-padding``, padded, on the eager
runner and on the compiled CPU runner.

The rule, whatever transformers release is installed: each decoder either
gives transformers' greedy tokens for every prompt, or is refused at load
with exit 2 and one line naming the reason; never a crash, never different
tokens. Which of the two happens is transformers' to decide (a release that
moves a decoder onto its attention interface lets the bridge keep it), so the
test asserts the rule, not the outcome."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from graphrunner_ref.cli import main as cli
from graphrunner_ref.engine.workload import Request
from hf_tiny import hf_greedy, swept_config, tiny_config

transformers = pytest.importorskip("transformers")

PROMPTS = [[3, 17, 5, 9, 22], [11, 2], [40, 41, 42]]
NEW_TOKENS = 4

_TOP2 = {"num_experts_per_tok": 2}
#: Decoders that run, by transformers ``model_type``: extra config arguments
#: (mixture-of-experts ones: 4 experts, top 2, rows run by the bridge's experts).
RUNS: dict[str, dict[str, Any]] = {
    "apertus": {},
    "arcee": {},
    "biogpt": {},
    "bitnet": {},
    "codegen": {"rotary_dim": 8},
    "cohere": {},
    "cohere2": {},
    "ernie4_5": {},
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_intermediate_size": 32, **_TOP2},
    "exaone4": {},
    "flex_olmo": {"num_experts": 4, **_TOP2},
    "gemma3_text": {},
    "glm": {},
    "glm4": {},
    "glm4_moe": {"n_routed_experts": 4, "moe_intermediate_size": 32, **_TOP2},
    "gpt2": {},
    "gpt_bigcode": {},
    "gpt_neox": {},
    "gpt_oss": {"num_local_experts": 4, **_TOP2},  # attention sinks, biased experts
    "gptj": {"rotary_dim": 8},
    "granite": {},
    "granitemoe": {"num_local_experts": 4, **_TOP2},
    "helium": {},
    "hunyuan_v1_dense": {},
    "hunyuan_v1_moe": {"num_experts": 4, "moe_intermediate_size": 32, **_TOP2},
    "ministral": {},
    "mistral": {},
    "mixtral": {"num_local_experts": 4, **_TOP2},
    "nemotron": {},
    "olmo": {},
    "olmo2": {},
    "olmo3": {},
    "olmoe": {"num_experts": 4, **_TOP2},
    "opt": {},
    "persimmon": {},
    "phi": {},
    "phi3": {},
    "phimoe": {"num_local_experts": 4, **_TOP2},
    "qwen2_moe": {
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        **_TOP2,
    },
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 32, **_TOP2},
    "seed_oss": {},
    "stablelm": {},
    "starcoder2": {},
}
#: Decoders the bridge refused at load under some transformers release (the
#: reason then in the comment); a newer release may let the bridge keep one.
REFUSED = {
    "bloom",  # attention outside transformers' interface
    "diffllama",  # the attention called more than once a layer
    "doge",  # an attention_mask of its own with a learned bias
    "falcon",  # attention outside the interface; kept token-exact from 5.25
    "minimax",  # linear attention in 1 of its 2 layers
    "mpt",  # attention outside the interface
    "xglm",  # attention outside the interface
    # Found by the whole-mapping sweep (bench/bridge_sweep.py), built as it builds them:
    "bart",  # positions from the sequence's length: the same query at positions 0 and 1
    "falcon_h1",  # Mamba mixers beside the attention: recurrent state
    "gemma4_text",  # a per-layer head_dim: K/V of different shapes
    "deepseek_v4",  # K/V compressed every 128 tokens
}
#: Built by :func:`hf_tiny.swept_config`, as the whole-mapping sweep builds them.
SWEPT = {"bart", "falcon_h1", "gemma4_text", "deepseek_v4"}
SWEEP = sorted({*RUNS, *REFUSED})


def _save(model_type: str, root: Path, **extra: Any) -> tuple[Path, Any]:
    config = (swept_config if model_type in SWEPT else tiny_config)(model_type, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="eager"
    ).eval()
    path = root / model_type
    model.save_pretrained(path)
    return path, model


def _generate(path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    prompts = path / "prompts.ids"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    capsys.readouterr()
    rc = cli.main(
        [
            "generate", "--model", str(path), "--model-impl", "transformers", "--prompts",
            str(prompts), "--prompts-format", "ids", "--max-new-tokens", str(NEW_TOKENS),
            "--runner", kind, "--capture-sizes", "1,2,4", "--check-padding", "--json",
        ]
    )  # fmt: skip
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rc, [r["token_ids"] for r in sorted(records, key=lambda r: r["index"])], err


def _expected(model: Any) -> list[list[int]]:
    trace = [Request(i, tuple(p), NEW_TOKENS) for i, p in enumerate(PROMPTS)]
    tokens = hf_greedy(model, trace)
    return [tokens[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("model_type", SWEEP)
@pytest.mark.parametrize("kind", ["eager", "cpu"])
def test_a_decoder_answers_as_transformers_or_is_refused_in_one_line(
    kind: str, model_type: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, model = _save(model_type, tmp_path, **RUNS.get(model_type, {}))
    rc, tokens, err = _generate(path, kind, capsys)
    if rc == 0:
        assert tokens == _expected(model), f"{model_type} ran with other tokens than transformers'"
        return
    assert rc == 2 and tokens == [], err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err


def test_a_checkpoint_transformers_cannot_build_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An activation transformers does not know: exit 2 and one line naming
    the checkpoint and transformers' reason, not a traceback."""
    path, _ = _save("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "hidden_act": "no_such_activation"}))
    rc, tokens, err = _generate(path, "eager", capsys)
    assert rc == 2 and tokens == []
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "no_such_activation" in lines[0] and str(path) in lines[0], err
    assert "Traceback" not in err
