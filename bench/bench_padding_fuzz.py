"""The padding fuzz (``tests/padding_fuzz.py``) on every phase x every
mechanism of this machine: each captured size replayed with every smaller
live batch and a full one, each buffer's tail poisoned with every pattern
first, with the sanitizer on and on the lean path without it; counts of what was compared and what went wrong
(mismatches, corruptions, sanitizer refusals and errors must all be 0).

Run: ``PYTHONPATH=. .venv/bin/python -m bench.bench_padding_fuzz`` (writes
``bench/results/padding-fuzz-cpu.md`` and ``.json``; on a CUDA machine the
CUDA mechanisms too, into ``padding-fuzz-<device>.md``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from functools import partial
from pathlib import Path

import torch

from bench.conftest import RESULTS_DIR, machine
from graphrunner.testing import torch_threads

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzz_cases import MECHANISMS, PHASES, make_case  # noqa: E402
from padding_fuzz import PATHS, PATTERNS, FuzzCounts, fuzz  # noqa: E402

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_padding_fuzz"
COLUMNS = (
    "phase",
    "mechanism",
    "replay paths",
    "(captured, live) sizes replayed",
    "poison patterns",
    "replays",
    "live rows compared",
    "mismatches",
    "state corruptions",
    "sanitizer refusals",
    "errors",
    "seconds (capture included)",
)


def _labels() -> list[str]:
    cuda = torch.cuda.is_available()
    return [m for m in MECHANISMS if m.startswith("cuda") == cuda or m in ("eager", "cpu")]


def _row(c: FuzzCounts, seconds: float) -> list[str]:
    values = (
        c.phase,
        c.mechanism,
        "+".join(c.paths),
        len(c.sizes),
        c.patterns,
        c.replays,
        c.live_rows,
        c.mismatches,
        c.corruptions,
        c.violations,
        c.errors,
        f"{seconds:.1f}",
    )
    return [str(v) for v in values]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8", help="captured sizes (default 1,2,4,8)")
    parser.add_argument("--mechanisms", default=",".join(_labels()))
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--seeds", type=int, default=3, help="fresh worlds per size and pattern")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    labels, phases = args.mechanisms.split(","), args.phases.split(",")
    rows, raw = [], []
    with torch_threads(1):
        for label in labels:
            for phase in phases:
                start = time.perf_counter()
                counts = fuzz(partial(make_case, phase, label, sizes), label, seeds=args.seeds)
                seconds = time.perf_counter() - start
                rows.append(_row(counts, seconds))
                raw.append({**counts.as_dict(), "seconds": seconds})
                print(" | ".join(rows[-1]), flush=True)
    info = machine()
    slug = (
        "cpu"
        if not torch.cuda.is_available()
        else re.sub(r"[^a-z0-9]+", "-", info["device"].lower()).strip("-")
    )
    out = RESULTS_DIR / f"padding-fuzz-{slug}.md"
    header = [
        "# padding fuzz",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        f"- command: `{CMD}`",
        f"- captured sizes: {sizes}; live batches 1..{sizes[-1]} (every captured size "
        "with fewer live rows than it, and with as many)",
        "- replay paths: `sanitized` (the phase's padding sanitizer on, vocab size given) and "
        "`lean` (the same runner without it)",
        f"- fresh worlds (requests, lengths, bystanders) per size and pattern: {args.seeds}",
        "- slot 0 of every KV layer and of the Mamba state (what padded rows read) holds "
        "the pattern's float too",
        f"- poison patterns (float tail / integer tail; bool tails True): {', '.join(PATTERNS)}",
        "- live rows compared with the eager forward of the unpadded batch (floats within "
        "1e-5, integers exact); state corruptions: rows of req_to_token, KV or Mamba state "
        "that changed without a live owner (KV slot 0 is the only sink), or live rows "
        "unlike eager's",
        "",
    ]
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    totals = {
        k: sum(r[k] for r in raw) for k in ("mismatches", "corruptions", "violations", "errors")
    }
    out.write_text("\n".join([*header, *table, "", f"totals: {json.dumps(totals)}"]) + "\n")
    payload = {
        "machine": info,
        "command": CMD,
        "sizes": sizes,
        "seeds": args.seeds,
        "patterns": list(PATTERNS),
        "paths": list(PATHS),
        "runs": raw,
    }
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"results written to {out} and {out.with_suffix('.json')}")
    return 0 if not any(totals.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
