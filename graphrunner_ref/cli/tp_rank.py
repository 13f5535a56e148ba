"""One rank of a ``--tp`` run: join, run the command, report a failure.

:func:`as_rank` runs the command as rank ``rank`` of ``world`` (spawned by
``--tp N``, started by ``torchrun``, or alone for ``--tp 1``) and returns
its exit status or how it failed (:class:`Failure`, one line, for the
launcher to print); rank 0 alone keeps its output files, and a stdin
prompt list is rank 0's, broadcast.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphrunner import PaddingViolation
from graphrunner.util import MissingExtraError
from graphrunner_ref.cli.common import UsageError, resolve_device
from graphrunner_ref.cli.exits import quiet_stdout
from graphrunner_ref.model.parallel import TensorParallel

__all__ = ["FAIL_RANK_ENV", "Failure", "as_rank", "one_line", "reads_stdin", "silence"]

#: A rank number: that worker raises right after joining its group (for tests).
FAIL_RANK_ENV = "GRAPHRUNNER_TP_FAIL_RANK"
#: Output-file arguments only rank 0 acts on (cleared on the other ranks).
_RANK0_FILES = ("output", "batch_sizes_out", "capture_report_out", "trace_out")


def reads_stdin(args: argparse.Namespace) -> bool:
    """Whether the command reads its prompts from stdin (``--prompts -``)."""
    return str(getattr(args, "prompts", None)) == "-"


@dataclass(frozen=True, slots=True)
class Failure:
    """How a rank failed: its exit status, its error in one line, when."""

    rank: int
    code: int
    line: str
    time: float


def as_rank(
    args: argparse.Namespace,
    rank: int,
    world: int,
    local: int,
    join: Callable[[], None],
    stdin: bytes | None,
) -> int | Failure:
    """Run the command as rank ``rank`` of ``world`` (``stdin``: rank 0's, when
    forwarded); its exit status, or how it failed."""
    try:
        _, device = resolve_device(args.runner, args.device, torch.cuda.is_available())
        if device != "cpu":  # NCCL needs the rank's device current before it joins
            args.device = f"cuda:{local}"
            torch.cuda.set_device(local)
        join()  # the caller leaves the group (after reporting a failure)
        if os.environ.get(FAIL_RANK_ENV) == str(rank):
            raise RuntimeError(f"{FAIL_RANK_ENV}={rank}: a planted failure")
        # Alone in its group, the rank still runs the collectives (--tp 1 tests that path).
        args.tensor_parallel = TensorParallel(rank, world, communicate_alone=world == 1)
        for name in _RANK0_FILES if rank else ():
            if hasattr(args, name):
                setattr(args, name, None)
        if reads_stdin(args):
            share_stdin(rank, stdin)
        return int(args.func(args))
    except BrokenPipeError:
        quiet_stdout()
        return 141
    except (UsageError, MissingExtraError) as e:
        return Failure(rank, 2, f"error: {one_line(e)}", time.monotonic())
    except PaddingViolation as e:
        return Failure(rank, 1, f"padding violation: {one_line(e)}", time.monotonic())
    except Exception as e:
        return Failure(rank, 1, f"{type(e).__name__}: {one_line(e)}", time.monotonic())


def share_stdin(rank: int, stdin: bytes | None) -> None:
    """Every rank's stdin becomes rank 0's (read there, broadcast)."""
    mine = (stdin if stdin is not None else sys.stdin.buffer.read()) if rank == 0 else None
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    sys.stdin = io.TextIOWrapper(io.BytesIO(box[0] or b""), encoding="utf-8")


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or repr(e)


def silence() -> int:
    """Point stdout and stderr at /dev/null; returns a descriptor of the former stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)
    return saved
