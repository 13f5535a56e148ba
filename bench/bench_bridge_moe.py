"""A mixture-of-experts decoder through the transformers bridge against
transformers' ``generate``, on the CPU, steady-state decode, in one run.

No MoE checkpoint is at hand offline, so the model is a random one made by
transformers from a config (``--arch``: Qwen3-MoE or Mixtral, 4 layers,
hidden 512, 8 experts, top 2; seeded, saved once under ``--root``), decoding
8 random prompts of 20-44 tokens, ``--new`` greedy tokens each, one torch
thread; at batch 8 the prompts decode together, at batch 1 one at a time.
Rows: transformers' ``generate`` (float32, its default experts dispatch),
the baseline and the reference tokens; the bridge on the compiled CPU runner
(float32, each row's own experts: :mod:`graphrunner_ref.bridge.experts`).
Decode tokens/s excludes prefill, as :mod:`bench.bench_bridge_cpu` measures
it; on a shared machine ``--repeat N`` measures every cell N times, the
rounds interleaved, and keeps each cell's best. Goal: the bridge >= 1.0x
``generate`` at batch 8 and 1.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_bridge_moe``
(writes ``bench/results/bridge-moe-<arch>-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.bench_bridge_cpu import bridge_run
from bench.bench_real_cpu import agreement, run_record, save_results, transformers_run
from graphrunner.testing import torch_threads

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_bridge_moe"
#: ``--arch``: the config of each random MoE decoder.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 512, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 8},
}
SHAPE: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    initializer_range=0.05,
    pad_token_id=0,
)
BATCH = 8


def checkpoint(arch: str, root: Path) -> Path:
    """The random ``arch`` decoder saved under ``root`` (made once)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    path = root / f"bench-moe-{arch}"
    if not (path / "config.json").is_file():
        config = CONFIG_MAPPING[arch](**SHAPE, **ARCHS[arch])
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.linspace(20, 44, BATCH).round().long().tolist()
    return [torch.randint(3, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=list(ARCHS), default="qwen3_moe")
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt (32)")
    p.add_argument("--batches", default="8,1")
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--repeat", type=int, default=1, help="rounds; each cell keeps its best (1)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    path, texts = checkpoint(args.arch, args.root), prompts()
    best: dict[tuple[int, str], dict[str, Any]] = {}
    load = os.getloadavg()[0]
    with torch_threads(1):
        for _ in range(args.repeat):
            for bs in (int(b) for b in args.batches.split(",")):
                hf_tps, hf_tokens = transformers_run(path, texts, bs, args.new)
                tps, tokens = bridge_run(path, texts, None, bs, args.new)
                print(f"bs {bs}: generate {hf_tps:.1f}, bridge {tps:.1f} tok/s", flush=True)
                for who, speed, got in (
                    ("transformers generate", hf_tps, hf_tokens),
                    ("bridge, cpu runner", tps, tokens),
                ):
                    row = {"bs": bs, "who": who, "tokens_per_s": speed, **agreement(got, hf_tokens)}
                    if (bs, who) not in best or best[bs, who]["tokens_per_s"] < speed:
                        best[bs, who] = row
    rows = list(best.values())
    shape = {**SHAPE, **ARCHS[args.arch]}
    facts = {"model": f"random {args.arch}, " + ", ".join(f"{k} {v}" for k, v in shape.items())}
    result = run_record(f"{CMD} {' '.join(argv)}", facts, args.new, load, texts, rows)
    result["repeat"] = args.repeat
    print(f"results written to {write(result, args.arch)}")
    return 0


def write(result: dict[str, Any], arch: str) -> str:
    lengths = result["prompt_lengths"]
    lines = [
        f"# A mixture-of-experts decoder ({arch}) through the bridge: decode tokens/s",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- one torch thread, float32, greedy, {result['new_tokens']} new tokens per prompt, "
        f"8 random prompts of {min(lengths)}-{max(lengths)} tokens; steady-state decode "
        f"(prefill excluded); each cell the best of {result['repeat']} interleaved run(s)",
        f"- load average before / after: {result['load'][0]:.1f} / {result['load'][1]:.1f} "
        f"(a shared {os.cpu_count()}-core machine)",
        "- agreement: with transformers' tokens at the same batch",
        "",
        "| batch | who | decode tok/s | vs generate | rows as generate | leading tokens |",
        "|---|---|---|---|---|---|",
    ]
    base = {r["bs"]: r["tokens_per_s"] for r in result["rows"] if r["who"].startswith("transf")}
    for r in result["rows"]:
        lines.append(
            f"| {r['bs']} | {r['who']} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base[r['bs']]:.2f}x | {r['agree']}/8 | "
            f"{r['prefix']:.1f} of {result['new_tokens']} |"
        )
    return save_results(f"bridge-moe-{arch.replace('_', '')}-cpu", lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
