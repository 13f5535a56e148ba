"""Start the ranks of a tensor-parallel run: N spawned processes, bounded waits.

Each rank joins a process group over a file store (no port to pick), with a
bounded collective timeout; :func:`run_ranks` returns once every rank exits
cleanly, raises the first failing rank's error (killing the others), or kills
them all past its timeout: no run hangs, no process outlives it. The tests,
the CPU bench and ``--tp N`` on the command line start their ranks here.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "exit_with_parent",
    "join_env_group",
    "join_group",
    "run_ranks",
]

COLLECTIVE_TIMEOUT_S = 60.0


def join_group(
    rank: int,
    world: int,
    store: Path,
    *,
    backend: str = "gloo",
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    threads: int = 1,
) -> None:
    """Join the ``backend`` group of ``world`` ranks that meet at the file
    ``store`` (which must not exist before the first rank joins), every
    collective bounded by ``timeout_s``; torch runs ``threads`` intra-op
    threads (the ranks share the machine's cores)."""
    torch.set_num_threads(threads)
    dist.init_process_group(
        backend,
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def join_env_group(
    *, backend: str = "gloo", timeout_s: float = COLLECTIVE_TIMEOUT_S, threads: int = 1
) -> None:
    """Join the group a launcher such as ``torchrun`` describes in the
    environment (``env://``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), bounded like :func:`join_group`."""
    torch.set_num_threads(threads)
    dist.init_process_group(
        backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s)
    )


def run_ranks(fn: Callable[..., None], world: int, *args: Any, timeout_s: float = 240.0) -> None:
    """Call ``fn(rank, *args)`` on ranks ``0..world - 1``, each in a spawned
    process (``fn`` must be importable: a module-level function)."""
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run_ranks: {world} ranks still running after {timeout_s} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process (status 1) soon after the process that started it
    dies: a spawned rank whose launcher was killed outright (SIGKILL runs no
    cleanup) would otherwise wait out its collective timeout as an orphan.
    A daemon thread polls the parent's pid every ``poll_s`` seconds; a
    multiprocessing child compares it with its launcher's, so one whose
    launcher died before the call exits at once."""
    launcher = multiprocessing.parent_process()
    parent = os.getppid() if launcher is None else launcher.pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
