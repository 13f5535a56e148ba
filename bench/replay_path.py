"""The plain replay path, counted: graphrunner modules and function calls from
the public ``GraphRunner.replay`` until the mechanism's launcher runs (a
captured size, no sanitizer, no profiler), on the toy world's eager runner.

    PYTHONPATH=. .venv/bin/python -m bench.replay_path
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import graphrunner
from graphrunner import create_runner, decode_buffer_specs
from graphrunner.testing import ToyWorld

PACKAGE = str(Path(graphrunner.__file__).parent)


def replay_path() -> tuple[list[str], list[str]]:
    """(calls, modules) of graphrunner code from ``replay`` to the launch."""
    world = ToyWorld()
    runner = create_runner(
        world.model.forward,
        decode_buffer_specs(),
        capture_sizes=[4],
        show_progress=False,
        kind="eager",
    )
    runner.capture()
    batch = world.make_batch(3, seed=0)
    runner.replay(batch)  # first sight of the batch's type: validated once
    batch = world.make_batch(3, seed=1)
    calls: list[str] = []
    launched = [False]
    forward_code = type(world.model).forward.__code__

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or launched[0]:
            return
        if frame.f_code is forward_code:  # the launch reached the model
            launched[0] = True
            return
        if frame.f_code.co_filename.startswith(PACKAGE):
            where = frame.f_code.co_filename[len(PACKAGE) + 1 :]
            calls.append(f"{where}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        runner.replay(batch)
    finally:
        sys.setprofile(None)
    modules = sorted({c.split(":")[0] for c in calls})
    return calls, modules


def main() -> None:
    calls, modules = replay_path()
    print(f"{len(calls)} graphrunner calls in {len(modules)} modules before the launch:")
    for call in calls:
        print("  ", call)


if __name__ == "__main__":
    main()
