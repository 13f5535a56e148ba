"""llama.cpp (through ``llama-cpp-python``'s C API bindings) decoding the same
prompts greedily from a GGUF file, one thread, for :mod:`bench.bench_real_cpu`.

Every prompt is its own sequence of one context (``n_seq_max`` = the batch):
each is prefilled alone, then every decode step is one ``llama_decode`` of
one token per sequence, as the graphrunner engine's steps are. Only the
decode steps are timed; the greedy pick (a numpy argmax over the logits
llama.cpp returns) is inside that time, as graphrunner's sampling is.
A :class:`LlamaCppDecoder` opens its context once and decodes the prompts
round after round over it (``bench_real_cpu --rounds``); :func:`llama_cpp_run`
is one round of a fresh one.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LlamaCppDecoder",
    "llama_cpp_available",
    "llama_cpp_logits",
    "llama_cpp_run",
    "llama_cpp_system",
]


def llama_cpp_available() -> bool:
    """Whether ``llama_cpp`` imports here."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_system() -> str:
    """llama-cpp-python's version and the CPU features its build uses."""
    import llama_cpp as lc

    info = lc.llama_print_system_info().decode().strip()
    return f"llama-cpp-python {lc.__version__}: {info}"


@functools.cache
def _quiet() -> Any:
    """A log callback that drops llama.cpp's log lines (one, kept alive by the cache)."""
    import llama_cpp as lc

    return lc.llama_log_callback(lambda level, text, data: None)


class _Context:
    """One model and context of ``sequences`` sequences, one thread."""

    def __init__(self, gguf: Path, sequences: int, context: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_log_set(_quiet(), None)
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = sequences * context
        cparams.n_batch = cparams.n_ubatch = max(context, sequences)
        cparams.n_seq_max = sequences
        cparams.n_threads = cparams.n_threads_batch = 1
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(max(context, sequences), 0, sequences)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Run ``(token, position, sequence, wants_logits)`` entries as one batch;
        the greedy next token of each entry that wants logits, in order."""
        return [int(np.argmax(row)) for row in self.logits(entries)]

    def logits(self, entries: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Run ``(token, position, sequence, wants_logits)`` entries as one batch;
        the float32 logits ``[vocab]`` of each entry that wants them, in order."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = []
        for i, (*_, logits) in enumerate(entries):
            if logits:
                row = self.lc.llama_get_logits_ith(self.ctx, i)
                rows.append(np.ctypeslib.as_array(row, shape=(self.vocab,)).copy())
        return rows

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class LlamaCppDecoder:
    """llama.cpp on ``gguf``, prepared once to decode ``prompts`` ``bs`` at a
    time (``new`` tokens each): its context is opened here, and each
    :meth:`decode` (one round) reuses it, clearing its memory per group.

    ``who`` is its row's label; :meth:`close` frees the context and model.
    """

    def __init__(self, gguf: Path, prompts: list[list[int]], bs: int, new: int) -> None:
        self.who = f"llama.cpp on {gguf.name}"
        self.prompts, self.bs, self.new = prompts, bs, new
        self.run = _Context(gguf, bs, max(len(p) for p in prompts) + new)
        self._open = True

    def decode(self) -> tuple[float, list[list[int]]]:
        """One round: decode tokens/s (prefill excluded) and each prompt's
        ``new`` greedy tokens, in prompt order."""
        run, prompts, bs, new = self.run, self.prompts, self.bs, self.new
        outputs: list[list[int]] = []
        decode_s, decoded = 0.0, 0
        for start in range(0, len(prompts), bs):
            group = prompts[start : start + bs]
            run.lc.llama_memory_clear(run.lc.llama_get_memory(run.ctx), True)
            tokens: list[list[Any]] = []
            for seq, prompt in enumerate(group):
                last = len(prompt) - 1
                entries = [(t, pos, seq, pos == last) for pos, t in enumerate(prompt)]
                tokens.append(run.decode(entries))
            begin = time.perf_counter()
            for step in range(new - 1):
                entries = [
                    (tokens[s][-1], len(group[s]) + step, s, True) for s in range(len(group))
                ]
                for s, pick in enumerate(run.decode(entries)):
                    tokens[s].append(pick)
            decode_s += time.perf_counter() - begin
            decoded += len(group) * (new - 1)
            outputs += tokens
        return decoded / decode_s, outputs

    def close(self) -> None:
        """Free the context and model (a second call does nothing)."""
        if self._open:
            self._open = False
            self.run.close()


def llama_cpp_run(
    gguf: Path, prompts: list[list[int]], bs: int, new: int
) -> tuple[float, list[list[int]]]:
    """Decode tokens/s (prefill excluded) and each prompt's ``new`` greedy
    tokens, the prompts run ``bs`` at a time, one thread: one round of a
    :class:`LlamaCppDecoder`, closed after it."""
    decoder = LlamaCppDecoder(gguf, prompts, bs, new)
    try:
        return decoder.decode()
    finally:
        decoder.close()


def llama_cpp_logits(gguf: Path, sequences: list[list[int]]) -> list[np.ndarray]:
    """Each sequence run whole through llama.cpp (one thread): its logits at
    every position, float32 ``[len, vocab]`` (teacher-forced)."""
    run = _Context(gguf, 1, max(len(s) for s in sequences))
    try:
        out = []
        for tokens in sequences:
            run.lc.llama_memory_clear(run.lc.llama_get_memory(run.ctx), True)
            out.append(np.stack(run.logits([(t, i, 0, True) for i, t in enumerate(tokens)])))
        return out
    finally:
        run.close()
