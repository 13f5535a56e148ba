"""Module moves of one chunked-prefill engine step, as issue 70 counts them.

``sys.setprofile`` records, at each Python call and return during one
``Engine.step()``, the module of the innermost ``graphrunner_ref/engine``
frame; the moves are the changes of that module, the returns the moves to a
module the step had already left. The step: two prompts (10 and 39 tokens)
under a budget of 16 tokens a step, the embedded model, eager runner; the
first step is taken untraced, the second (prompt chunks and a decode) traced.

``.venv/bin/python dev/trace_step.py`` from the repository root.
"""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

sys.path.insert(0, os.getcwd())

from graphrunner_ref.engine.config import EngineConfig  # noqa: E402
from graphrunner_ref.engine.serving import build, open_engine  # noqa: E402
from graphrunner_ref.engine.workload import Request  # noqa: E402

ROOT = os.path.join(os.getcwd(), "graphrunner_ref", "engine") + os.sep


def _module(frame: FrameType | None) -> str | None:
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(ROOT):
            return name[len(ROOT) :]
        frame = frame.f_back
    return None


def traced_step() -> list[str]:
    """The engine modules one chunked-prefill step passes through, in order."""
    config = EngineConfig(
        runner="eager", capture_sizes=(1, 2, 4), quiet=True, max_num_batched_tokens=16
    )
    bundle = build(config, max_requests=4, context=96)
    trace = [Request(0, tuple(range(3, 13)), 4), Request(1, tuple(range(20, 59)), 4)]
    engine = open_engine(config, bundle, trace=trace)
    for r in trace:
        engine.add_request(list(r.prompt), r.max_new_tokens, rid=r.rid + 100)
    engine.step()
    seq: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        module = _module(frame if event == "call" else frame.f_back)
        if module is not None and (not seq or seq[-1] != module):
            seq.append(module)

    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    return seq


def main() -> int:
    seq = traced_step()
    returns = sum(1 for i, m in enumerate(seq) if m in seq[:i])
    print(f"moves {len(seq) - 1}, returns to a module already left {returns}, "
          f"modules {len(set(seq))}")  # fmt: skip
    print(" > ".join(seq))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
