"""The plain replay path, counted: graphrunner modules and function calls from
the public ``GraphRunner.replay`` until the mechanism's launcher is entered (a
captured size, no sanitizer, no profiler), and the lines of ``replay``'s body.

Two runs: the toy world's forward with no backend, and the reference Llama
with its real attention backend (``validate_inputs`` reads the host mirrors'
ranges every step), both on the eager mechanism, whose populate and launch
are those of the CUDA mechanism's default (``populate="torch"``): the same
writer, then the launcher (a CUDA graph's ``launch`` there).

    PYTHONPATH=. .venv/bin/python -m bench.replay_path
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch

import graphrunner
from graphrunner import DecodeBatch, GraphRunner, create_runner, decode_buffer_specs
from graphrunner.testing import ToyWorld
from graphrunner_ref import default_model

PACKAGE = str(Path(graphrunner.__file__).parent) + "/"


def _trace(runner: GraphRunner, batch: object, launcher_code: object) -> list[str]:
    """The graphrunner calls of one replay of ``batch`` until ``launcher_code`` runs."""
    calls: list[str] = []
    launched = [False]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or launched[0]:
            return
        if frame.f_code is launcher_code:
            launched[0] = True
            return
        if frame.f_code.co_filename.startswith(PACKAGE):
            where = frame.f_code.co_filename[len(PACKAGE) :]
            calls.append(f"{where}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        runner.replay(batch)  # type: ignore[arg-type]
    finally:
        sys.setprofile(None)
    return calls


def _launcher_code(runner: GraphRunner, raw_bs: int) -> object:
    graph = runner._graph_for[raw_bs]  # the launcher this raw size replays
    return graph.launcher.__code__  # type: ignore[attr-defined]


def toy_path() -> list[str]:
    """The toy forward, no backend."""
    world = ToyWorld()
    runner = create_runner(
        world.model.forward,
        decode_buffer_specs(),
        capture_sizes=[4],
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    runner.replay(world.make_batch(3, seed=0))  # first sight of the batch's type
    return _trace(runner, world.make_batch(3, seed=1), _launcher_code(runner, 3))


def backend_path() -> list[str]:
    """The reference Llama with its attention backend, a DecodeBatch of 3."""
    bundle = default_model(max_requests=4, max_context_len=16)
    backend = bundle.model.attn_backend
    specs = decode_buffer_specs(seq_len_fill_value=backend.seq_len_fill_value)
    runner = create_runner(
        bundle.model.forward_decode,
        specs,
        kind="eager",
        backend=backend,
        capture_sizes=[4],
        show_progress=False,
    )
    runner.capture()
    rows = bundle.req_pool.alloc(3)
    batch = DecodeBatch.from_requests(
        rows, [2, 2, 2], torch.tensor([4, 5, 6]), device="cpu", max_context_len=16
    )
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    runner.replay(batch)
    batch.prepare_decode(bundle.req_pool, bundle.kv_alloc)
    return _trace(runner, batch, _launcher_code(runner, 3))


def replay_lines() -> int:
    """Lines of ``GraphRunner.replay``'s body (its code, less the docstring)."""
    source = inspect.getsource(GraphRunner.replay)
    body = source.split('"""', 2)[2].splitlines()
    return sum(1 for line in body if line.strip() and not line.strip().startswith("#"))


def main() -> None:
    for name, calls in (("toy, no backend", toy_path()), ("Llama + backend", backend_path())):
        modules = sorted({c.split(":")[0] for c in calls})
        print(f"{name}: {len(calls)} graphrunner calls in {len(modules)} modules before the launch")
        print("   modules:", ", ".join(modules))
        for call in calls:
            print("     ", call)
    print(f"replay's body: {replay_lines()} lines")


if __name__ == "__main__":
    main()
