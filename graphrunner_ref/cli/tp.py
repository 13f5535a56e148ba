"""``--tp N``: ``generate`` and ``demo`` on N tensor-parallel ranks.

Without ``torchrun`` the command starts its N worker processes itself
(spawned by :func:`~graphrunner_ref.engine.launch.run_ranks`, meeting at a file
store in a temporary directory; gloo on the CPU, NCCL with one GPU a rank on
CUDA). Every rank parses the same arguments, loads its shard and runs the
same engine on the same trace (SPMD). Rank 0 decides: each engine step admits
rank 0's count of requests (:func:`~graphrunner_ref.engine.ranks.rank0_admits`),
and a stdin prompt list is rank 0's (forwarded to it by the launching
process), broadcast to the others. Rank 0 alone prints and writes outputs:
the other ranks' stdout and stderr go to /dev/null and their output-file
arguments are cleared. Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` set) the process is one rank of the ``env://`` group and
spawns nothing; ``--tp`` is then omitted or equals ``WORLD_SIZE``. ``--tp 1``
spawns nothing either: the process joins a group of its own and runs the
sharded model's collectives over it (TP = N's path, with one process's
numbers); without ``--tp`` no group is joined and nothing is communicated.

A rank that raises or dies ends the run: the others are killed, and the
command prints one line naming the first rank to fail and its error (exit 1,
2 for a usage error). What does not combine with ``--tp N`` (N > 1) yet is
refused before any rank starts (exit 2, naming the flag).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import multiprocessing.util
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from graphrunner_ref.cli import checks as cli_checks
from graphrunner_ref.cli.common import UsageError, check_range, resolve_device
from graphrunner_ref.cli.tp_rank import (
    FAIL_RANK_ENV,
    Failure,
    as_rank,
    one_line,
    reads_stdin,
    silence,
)
from graphrunner_ref.engine.launch import exit_with_parent, join_env_group, join_group, run_ranks
from graphrunner_ref.model.parallel import TensorParallel, check_shardable

__all__ = ["FAIL_RANK_ENV", "Parse", "run", "runs_ranks"]

#: A bound on a spawned run, not a budget: a hang ends at a collective's timeout.
_RUN_TIMEOUT_S = 7 * 24 * 3600.0

#: Parses a command line as the command does (``--model`` resolved).
Parse = Callable[[list[str]], argparse.Namespace]


def runs_ranks(args: argparse.Namespace) -> bool:
    """Whether the command runs as tensor-parallel ranks: ``--tp`` given, or
    started by ``torchrun`` (a serving command only)."""
    return hasattr(args, "tp") and (args.tp is not None or _torchrun_env() is not None)


def run(args: argparse.Namespace, argv: list[str], parse: Parse) -> int:
    """The command of ``args`` (parsed from ``argv`` by ``parse``) as this
    ``torchrun`` rank, or on ``--tp N`` ranks (spawned here; ``--tp 1``: this
    process alone in a group)."""
    env = _torchrun_env()
    if env is not None:
        return _torchrun(args, *env)
    if args.tp == 1:
        return _one_rank(args)
    device = _check(args, args.tp, spawned=True)
    stdin = sys.stdin.buffer.read() if reads_stdin(args) else None
    with tempfile.TemporaryDirectory(prefix="graphrunner-tp-") as tmp:
        where = Path(tmp)
        try:
            ranks = (args.tp, _backend(device), parse, argv, stdin, where)
            with _quiet_spawn_log():  # torch's line per rank it ends: ours names the cause
                run_ranks(_worker, args.tp, *ranks, timeout_s=_RUN_TIMEOUT_S)
        except (mp.ProcessRaisedException, mp.ProcessExitedException, TimeoutError) as e:
            return _failed(f"graphrunner {args.command}", where, e)
    return 0


@contextlib.contextmanager
def _quiet_spawn_log() -> Iterator[None]:
    log = logging.getLogger("torch.multiprocessing.spawn")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _torchrun_env() -> tuple[int, int, int] | None:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(n in os.environ for n in names):
        return None
    try:
        rank, world, local = (int(os.environ[n]) for n in names)
    except ValueError:
        found = ", ".join(f"{n}={os.environ[n]!r}" for n in names)
        raise UsageError(f"torchrun environment {found}: expected ints") from None
    return rank, world, local


def _check(args: argparse.Namespace, world: int, *, spawned: bool) -> str:
    """Refuse (UsageError naming the flag) what ``--tp world`` cannot run;
    returns the device the ranks run on."""
    _, device = resolve_device(args.runner, args.device, torch.cuda.is_available())
    if spawned:
        cuda = device != "cpu"
        limit = torch.cuda.device_count() if cuda else os.cpu_count() or 1
        check_range("--tp", world, 1, limit, "this machine's " + ("GPUs" if cuda else "cores"))
    flag = f"--tp {world}"
    if device.startswith("cuda:") and world > 1:
        raise UsageError(f"{flag} with --device {device}: expected --device cuda (rank r: cuda:r)")
    if world == 1:  # one rank decides alone: every schedule and model runs as without --tp
        return device
    for given, other in (
        (args.speculative, "--speculative"),
        (args.overlap, "--overlap"),
        (args.steps_per_launch > 1, f"--steps-per-launch {args.steps_per_launch}"),
    ):
        if given:
            raise UsageError(f"{flag} with {other}: not combined yet; expected one of them")
    try:  # a .gguf file is converted here, once, before the ranks read the cache
        check_shardable(cli_checks.model_config(args), TensorParallel(0, world))
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    return device


def _backend(device: str) -> str:
    return "gloo" if device == "cpu" else "nccl"


def _one_rank(args: argparse.Namespace) -> int:
    """``--tp 1``: this process as the one rank of a group of its own (nothing
    spawned), so the sharded model's collectives run, compiled and captured,
    as they do on N ranks."""
    device = _check(args, 1, spawned=True)
    local = torch.device(device).index or 0
    with tempfile.TemporaryDirectory(prefix="graphrunner-tp-") as tmp:
        store = Path(tmp) / "store"
        join = lambda: join_group(0, 1, store, backend=_backend(device))  # noqa: E731
        return _in_process(args, 0, 1, local, join, sys.stderr)


def _torchrun(args: argparse.Namespace, rank: int, world: int, local: int) -> int:
    if args.tp is not None and args.tp != world:
        raise UsageError(
            f"--tp {args.tp}: torchrun started WORLD_SIZE={world} ranks; expected --tp "
            f"{world} or no --tp"
        )
    args.tp = world  # the ranks torchrun started, as --tp would say
    backend = _backend(_check(args, world, spawned=False))
    stderr = os.fdopen(silence(), "w") if rank else sys.stderr  # its failure's line only
    join = lambda: join_env_group(backend=backend)  # noqa: E731
    return _in_process(args, rank, world, local, join, stderr)


def _in_process(
    args: argparse.Namespace,
    rank: int,
    world: int,
    local: int,
    join: Callable[[], None],
    stderr: TextIO,
) -> int:
    """This process as rank ``rank`` (``--tp 1``, or a torchrun rank): its exit
    status; a failure's one line on ``stderr``; the group left however it ends."""
    try:
        result = as_rank(args, rank, world, local, join, None)
    finally:  # interrupted too: leave the group
        if dist.is_initialized():
            dist.destroy_process_group()
    if isinstance(result, Failure):
        # One write, the newline in it: torchrun's ranks share the terminal.
        stderr.write(f"graphrunner {args.command}: rank {rank}: {result.line}\n")
        stderr.flush()
        return result.code
    return result


def _worker(
    rank: int,
    world: int,
    backend: str,
    parse: Parse,
    argv: list[str],
    stdin: bytes | None,
    where: Path,
) -> None:
    """A spawned rank: its exit status is the command's; a failure is also
    written to ``where`` for the launching process to report."""
    exit_with_parent()  # a launcher killed outright leaves no orphan rank
    if rank:
        silence()
    args = parse(argv)
    store = where / "store"
    join = lambda: join_group(rank, world, store, backend=backend)  # noqa: E731
    result = as_rank(args, rank, world, rank, join, stdin if rank == 0 else None)
    if isinstance(result, Failure):  # written before this rank's connections close
        (where / f"rank{rank}.failure.json").write_text(json.dumps(dataclasses.asdict(result)))
    sys.stdout.flush()
    sys.stderr.flush()
    # Out without the interpreter's teardown (seconds with torch loaded; the
    # group's connections close with the process): multiprocessing's own exit
    # steps (its finalizers: no semaphore left to its tracker), then the status.
    vars(multiprocessing.util)["_exit_function"]()
    os._exit(result.code if isinstance(result, Failure) else result)


def _failed(name: str, where: Path, e: Exception) -> int:
    """The run's exit status once a rank failed, after one line on stderr
    naming the first rank to fail (rank 0's own exit status 1 without a
    failure: its report is printed already)."""
    found = [json.loads(p.read_text()) for p in where.glob("rank*.failure.json")]
    if found:
        first = min(found, key=lambda f: f["time"])
        print(f"{name}: rank {first['rank']}: {first['line']}", file=sys.stderr)
        return int(first["code"])
    if isinstance(e, mp.ProcessExitedException) and e.error_index == 0 and e.exit_code > 0:
        return int(e.exit_code)
    if isinstance(e, mp.ProcessExitedException) and e.signal_name is not None:
        print(f"{name}: rank {e.error_index}: killed by {e.signal_name}", file=sys.stderr)
    elif isinstance(e, mp.ProcessRaisedException):
        print(f"{name}: rank {e.error_index}: {str(e).strip().splitlines()[-1]}", file=sys.stderr)
    else:
        print(f"{name}: {one_line(e)}", file=sys.stderr)
    return 1
