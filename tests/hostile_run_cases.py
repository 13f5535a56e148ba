"""Hostile-inputs table, runs: requests, prompt and sizing files, device
values, interruption, concurrency and output files (the builders and cases
are the existing tests' own)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import test_atomic
import test_decode_runner_vocab as decode_vocab
import test_phase_sanitizer as phases
from hostile_table import Case, Outcome, World, api_outcome, cli_outcome, environ, first_line
from test_cli_sizes import BAD_REPORT_TEXTS, BAD_TRACE_FILES
from test_concurrent_use import (
    REQUEST_CASES,
    engine_run_from_a_second_thread,
    interrupt_at_every_step,
    replay_from_a_second_thread,
)
from test_killed_conversion import _dead_pid, test_an_output_write_removes_what_a_killed_write_left

import graphrunner_ref.cli.main as cli
import graphrunner_ref.io.gguf_cache as gguf_cache
import graphrunner_ref.io.gguf_import as gguf_import
from graphrunner.util.atomic import write_atomically
from graphrunner.util.temp import temp_path
from graphrunner_ref.engine import serving
from graphrunner_ref.engine.loop import Engine, create_decode_runner
from graphrunner_ref.engine.workload import Request
from graphrunner_ref.model import default_model
from spec_world import SpecWorld
from test_cli import BAD_PROMPT_FILES
from test_engine import _engine
from test_gguf_hostile import write

__all__ = ["run_cases"]

EAGER = ["--runner", "eager", "--capture-sizes", "1,2", "--max-new-tokens", "16"]


def _request(kwargs: dict[str, object], w: World) -> Outcome:
    fields: dict[str, Any] = {"rid": 0, "prompt": (1, 2), "max_new_tokens": 3, **kwargs}
    return api_outcome(lambda: Request(**fields))


def _engine_request(request: Request, w: World) -> Outcome:
    engine = _engine()
    outcome = api_outcome(lambda: engine.run([Request(1, (5,), 3), request]))
    assert engine.runner.stats.replays == 0, "a step ran before the refusal"
    return outcome


def _prompt_file(content: str, w: World) -> Outcome:
    path = w.dir("prompt-file") / "prompts.jsonl"
    path.write_text(content)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(serving, "build", lambda *a: pytest.fail("built a model"))
        return cli_outcome(["generate", "--prompts", str(path), "--runner", "eager"])


def _trace_file(text: str, w: World) -> Outcome:
    path = w.dir("trace") / "trace.txt"
    path.write_text(text)
    return cli_outcome(["sizes", "--trace", str(path), "--graphs", "2"])


def _report_file(text: str, w: World) -> Outcome:
    folder = w.dir("report")
    (folder / "trace.txt").write_text("3\n5\n12\n")
    (folder / "r.json").write_text(text)
    return cli_outcome(["sizes", "--trace", str(folder / "trace.txt"), "--graphs", "2",
                        "--memory-budget", "5000", "--capture-report", str(folder / "r.json")])  # fmt: skip


def _token_outside_vocab(phase: str, w: World) -> Outcome:
    world = SpecWorld()
    vocab = world.model.config.vocab_size
    runner = phases._runner(world, phase, vocab_size=vocab)
    inputs = phases._inputs(world, phase, seed=7)
    phases._set(inputs, "input_ids", 1, vocab)
    return api_outcome(lambda: runner.replay(inputs))


def _decode_token_outside_vocab(w: World) -> Outcome:
    bundle = default_model(max_requests=8, max_context_len=32)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[4], check_padding=True)
    runner.capture()
    batch = decode_vocab.batch_with_token(bundle, bundle.config.vocab_size)
    return api_outcome(lambda: runner.replay(batch))


def _free(bundle: Any) -> tuple[int, int]:
    return bundle.req_pool.available_size(), bundle.kv_alloc.available_size()


def _failing_callback(error: type[BaseException], w: World) -> Outcome:
    bundle = default_model(max_requests=2, max_context_len=48)
    runner = create_decode_runner(bundle, "eager", capture_sizes=[1, 2])
    runner.capture()
    start = _free(bundle)

    def on_finish(rid: int, tokens: list[int]) -> None:
        raise error(f"the callback failed for request {rid}")

    try:
        Engine(bundle, runner, on_finish=on_finish).run(
            [Request(0, (1, 2, 3), 4), Request(1, (4,), 2)]
        )
        outcome = Outcome("ok", "")
    except (Exception, KeyboardInterrupt) as e:  # the callback's own error, re-raised
        outcome = Outcome(type(e).__name__, first_line(e))
    assert _free(bundle) == start, "a slot was lost"
    return outcome


def _every_step(w: World) -> Outcome:
    raised, freed, exact = interrupt_at_every_step()
    assert all(freed) and exact, (freed, exact)
    kinds = {type(e).__name__ for e in raised}
    return Outcome(" ".join(sorted(kinds)), f"at each of {len(raised)} steps: every slot "
                   "free after, the next run exact")  # fmt: skip


def _signal_mid_generate(sig: signal.Signals, w: World) -> Outcome:
    made: list[tuple[Any, tuple[int, int]]] = []

    def create(bundle: Any, *args: Any, **kwargs: Any) -> Any:
        runner = create_decode_runner(bundle, *args, **kwargs)
        made.append((bundle, _free(bundle)))
        replay, calls = runner.replay, [0]

        def signalled(inputs: object) -> object:
            calls[0] += 1
            if calls[0] == 2:
                signal.raise_signal(sig)  # a real signal, to this process, mid-run
            return replay(inputs)

        runner.replay = signalled
        return runner

    # Ctrl-C as Python handles it at a terminal (a runner started as a
    # background job inherits SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(serving, "create_decode_runner", create)
            outcome = cli_outcome(["generate", "--prompts", str(w.prompts), *EAGER])
    finally:
        signal.signal(signal.SIGINT, previous)
    ((bundle, start),) = made
    assert _free(bundle) == start, "a slot was lost"
    return outcome


def _signal_mid_convert(w: World) -> Outcome:
    folder = w.dir("sigterm-convert")
    gguf = write(folder / "model.gguf")

    def half_written(tensors: Any, filename: str, metadata: Any = None) -> None:
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        signal.raise_signal(signal.SIGTERM)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf_import, "save_file", half_written)
        outcome = cli_outcome(["convert", "--gguf", str(gguf), "--out", str(folder / "out")])
    assert sorted(p.name for p in folder.iterdir()) == ["model.gguf"], "a temporary survived"
    return outcome


def _killed_convert_left(w: World) -> Outcome:
    folder = w.dir("sigkill-convert")
    gguf, out = write(folder / "model.gguf"), folder / "out"
    tag = temp_path(out).name.split(".")[2].split("-")[0]
    left = folder / f".out.{tag}-{_dead_pid()}-{'a' * 12}.tmp"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"half")
    outcome = cli_outcome(["convert", "--gguf", str(gguf), "--out", str(out)])
    assert sorted(p.name for p in folder.iterdir()) == ["model.gguf", "out"], "a temporary survived"
    return Outcome(outcome.kind, "the dead writer's temporary removed, the checkpoint written")


def _closed_pipe(w: World) -> Outcome:
    read, write_end = os.pipe()
    os.close(read)  # the reader has gone
    err = io.StringIO()
    with (
        open(write_end, "w", buffering=1) as out,  # a write reaches the pipe at once
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = cli.main(["generate", "--prompts", str(w.prompts), *EAGER])
    assert err.getvalue() == "", err.getvalue()
    return Outcome(f"exit {code}", "nothing on stderr")


def _two_threads(helper: Callable[[], tuple[list[BaseException], bool]], w: World) -> Outcome:
    errors, exact = helper()
    assert exact, "the run inside was disturbed"
    (error,) = errors
    return Outcome(type(error).__name__, first_line(error))


def _cache_race(w: World) -> Outcome:
    folder = w.dir("cache-race")
    gguf = write(folder / "model.gguf")
    waiting = threading.Event()
    real_flock, real_convert = fcntl.flock, gguf_cache.convert_gguf
    second = threading.Thread(target=gguf_cache.checkpoint_dir, args=(gguf,), name="second")

    def flock(fd: Any, operation: int) -> None:
        if threading.current_thread() is second and operation == fcntl.LOCK_EX:
            waiting.set()  # the second converter is at the lock the first holds
        real_flock(fd, operation)

    def convert(path: Any, out: Any) -> Any:
        second.start()
        assert waiting.wait(timeout=60)
        return real_convert(path, out)

    err = io.StringIO()
    with (
        environ("GRAPHRUNNER_CACHE", str(folder / "cache")),
        pytest.MonkeyPatch.context() as m,
        contextlib.redirect_stderr(err),
    ):
        m.setattr(fcntl, "flock", flock)
        m.setattr(gguf_cache, "convert_gguf", convert)
        out = gguf_cache.checkpoint_dir(gguf)
        second.join(timeout=60)
    verbs = sorted(line.split()[0] for line in err.getvalue().splitlines())
    assert verbs == ["converted", "using"] and (out / "config.json").is_file(), verbs
    return Outcome("ok", "one converted, the other waited on the lock and reused it")


def _atomic(test: Callable[[Any], None], observed: str, w: World) -> Outcome:
    try:
        test(w.dir("atomic"))
    except pytest.skip.Exception as e:  # no private device node here
        return Outcome("skipped", str(e))
    return Outcome("ok", observed)


def _socket(w: World) -> Outcome:
    path = w.dir("socket") / "s.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        return api_outcome(lambda: write_atomically(path, "x"))


def _full_disk(w: World) -> Outcome:
    out = w.dir("full") / "out.jsonl"
    out.write_text("old\n")

    def replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "replace", replace)
        outcome = cli_outcome(
            ["generate", "--prompts", str(w.prompts), *EAGER, "--output", str(out)]
        )
    assert out.read_text() == "old\n" and [p.name for p in out.parent.iterdir()] == [out.name]
    return outcome


def _fields(kwargs: dict[str, object]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items()).replace("\n", " ")


def _short(text: str, limit: int = 56) -> str:
    """``repr(text)``, its middle cut out past ``limit`` characters."""
    text = repr(text)
    half = limit // 2
    return text if len(text) <= limit else f"{text[: half - 1]}…{text[-half:]}"


def run_cases() -> list[Case]:
    generate = "graphrunner generate --prompts FILE"
    cases = [
        Case("Requests", _fields(kwargs), f"Request({_fields(kwargs)}, ...)",
             partial(_request, kwargs), "TypeError|ValueError", message)
        for kwargs, message in REQUEST_CASES
    ]  # fmt: skip
    cases += [
        Case("Requests", "token id 256 past a vocabulary of 256", "Engine.run(trace)",
             partial(_engine_request, Request(0, (1, 256), 4)), "ValueError",
             "token id 256 outside the vocabulary"),
        Case("Requests", "250 prompt tokens + 8 new past the context", "Engine.run(trace)",
             partial(_engine_request, Request(0, (1,) * 250, 8)), "ValueError", "257 tokens"),
    ]  # fmt: skip
    cases += [
        Case("Prompt files", _short(content), generate, partial(_prompt_file, content), "exit 2",
             message)
        for content, message in BAD_PROMPT_FILES
    ]  # fmt: skip
    cases += [
        Case("Sizing files", _short(text), "graphrunner sizes --trace FILE --graphs 2",
             partial(_trace_file, text), "exit 2", re.escape(message))
        for text, message in BAD_TRACE_FILES
    ]  # fmt: skip
    cases += [
        Case("Sizing files", _short(text), "graphrunner sizes ... --capture-report FILE",
             partial(_report_file, text), "exit 2", re.escape(message))
        for text, message in BAD_REPORT_TEXTS
    ]  # fmt: skip
    cases += [
        Case("Device values", f"input_ids = vocab_size on a live row, {phase}",
             "runner.replay(inputs) (sanitizer with vocab_size)",
             partial(_token_outside_vocab, phase), "PaddingViolation",
             r"input_ids batch row 1 = \d+: expected a token id in 0\.\.")
        for phase in ("verify", "eagle", "mtp")
    ]  # fmt: skip
    cases += [
        Case("Device values", "input_ids = vocab_size on a live row, decode",
             "create_decode_runner(..., check_padding=True).replay(batch)",
             _decode_token_outside_vocab, "PaddingViolation",
             r"input_ids batch row 1 = \d+: expected a token id in 0\.\.")
    ]  # fmt: skip
    cases += [
        Case("Interruption", "on_finish raises an exception: every slot freed",
             "Engine(..., on_finish=f).run(trace)", partial(_failing_callback, RuntimeError),
             "RuntimeError", "the callback failed for request 1"),
        Case("Interruption", "on_finish raises KeyboardInterrupt: every slot freed",
             "Engine(..., on_finish=f).run(trace)", partial(_failing_callback, KeyboardInterrupt),
             "KeyboardInterrupt", "the callback failed for request 1"),
        Case("Interruption", "KeyboardInterrupt inside the k-th replay, every k",
             "Engine.run(trace)", _every_step, "KeyboardInterrupt", "every slot free"),
        Case("Interruption", "SIGINT (Ctrl-C) mid-run: every slot freed", generate,
             partial(_signal_mid_generate, signal.SIGINT), "exit 130",
             "^graphrunner generate: interrupted$"),
        Case("Interruption", "SIGTERM mid-run: every slot freed", generate,
             partial(_signal_mid_generate, signal.SIGTERM), "exit 143",
             "^graphrunner generate: terminated$"),
        Case("Interruption", "SIGTERM while writing model.safetensors: no temporary left",
             "graphrunner convert --gguf F --out DIR", _signal_mid_convert, "exit 143",
             "^graphrunner convert: terminated$"),
        Case("Interruption", "the temporary a SIGKILLed conversion left",
             "graphrunner convert --gguf F --out DIR (again)", _killed_convert_left, "exit 0",
             "temporary removed"),
        Case("Interruption", "stdout closed by its reader", f"{generate} | (closed)",
             _closed_pipe, "exit 141", "nothing on stderr"),
        Case("Concurrency", "a second thread in a runner's replay", "runner.replay(batch)",
             partial(_two_threads, replay_from_a_second_thread), "ConcurrentUseError",
             r"GraphRunner.replay is already running \(in thread"),
        Case("Concurrency", "a second thread in an engine's run", "Engine.run(trace)",
             partial(_two_threads, engine_run_from_a_second_thread), "ConcurrentUseError",
             r"Engine.run is already running \(in thread"),
        Case("Concurrency", "two converters of one GGUF into the cache",
             "checkpoint_dir(F) in two threads", _cache_race, "ok", "waited on the lock"),
        Case("Output files", "--output names a directory", f"{generate} --output DIR",
             lambda w: cli_outcome(["generate", "--prompts", str(w.prompts), *EAGER,
                                    "--output", str(w.dir("out"))]),
             "exit 2", r"--output .*: is a directory"),
        Case("Output files", "--output in a missing directory", f"{generate} --output NO/F",
             lambda w: cli_outcome(["generate", "--prompts", str(w.prompts), *EAGER,
                                    "--output", str(w.root / "missing" / "f")]),
             "exit 2", r"directory .* does not exist"),
        Case("Output files", "a symlink", "write_atomically(LINK, text)",
             partial(_atomic, test_atomic.test_a_symlink_is_written_through_to_its_target,
                     "written through to its target; the link kept"), "ok", "target"),
        Case("Output files", "a dangling symlink", "write_atomically(LINK, text)",
             partial(_atomic, test_atomic.test_a_dangling_symlink_creates_its_target,
                     "its target created"), "ok", "target"),
        Case("Output files", "a FIFO", "write_atomically(FIFO, text)",
             partial(_atomic, test_atomic.test_a_fifo_reader_gets_the_text,
                     "written into the pipe; its reader gets the text"), "ok", "reader"),
        Case("Output files", "a character device (a private one)", "write_atomically(DEV, text)",
             partial(_atomic, test_atomic.test_a_character_device_is_written_not_replaced,
                     "written, the node not replaced"), "ok|skipped", ""),
        Case("Output files", "a 0600 file", "write_atomically(F, text)",
             partial(_atomic, test_atomic.test_an_existing_file_keeps_its_mode,
                     "replaced whole, still 0600"), "ok", "0600"),
        Case("Output files", "a directory", "write_atomically(DIR, text)",
             lambda w: api_outcome(lambda: write_atomically(w.dir("d"), "x")), "OSError",
             "is a directory; expected a regular file"),
        Case("Output files", "a socket", "write_atomically(SOCK, text)", _socket, "OSError",
             "is not a regular file"),
        Case("Output files", "the disk full at the rename", f"{generate} --output F",
             _full_disk, "exit 1", r"No space left on device"),
        Case("Output files", "a temporary a killed write left beside it",
             "write_atomically(F, text)",
             partial(_atomic, test_an_output_write_removes_what_a_killed_write_left,
                     "the temporary removed, the file written"), "ok", "removed"),
    ]  # fmt: skip
    return cases
