"""Every causal LM transformers ships through the bridge, as a new user runs it.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
a tiny random checkpoint is built offline from its config class
(:func:`hf_tiny.swept_config`: 2 layers, hidden 64, 4 heads, 4 experts of
top 2, every sub-config shrunk the same way; :data:`EXTRA` where a class
needs more), saved with ``save_pretrained`` and run through ``generate
--model DIR --model-impl transformers --runner eager --capture-sizes 1,2,4
--check-padding --json`` (3 prompts, padded steps, the sanitizer on),
against transformers' greedy ``generate`` of each prompt alone. Outcomes:

- ``run``: exit 0 and transformers' tokens for every prompt;
- ``refused``: exit 2 and one ``error:`` line naming why, no traceback;
- ``failed``: anything else (wrong tokens, another exit, a traceback, an
  exception out of the command, a padding violation, a timeout);
- ``not built``: transformers cannot build and run a tiny model of it
  offline (its config class refuses the shrunk fields, the model will not
  construct, or, where the bridge did not refuse it, transformers' own
  ``generate`` fails on it).

Each architecture runs in a worker process with one torch thread; one that
runs past ``--timeout`` seconds is killed, recorded as failed, and the
worker restarts on the rest. Run (about 10-20 minutes on 2 cores):
``PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.bridge_sweep``
(writes ``bench/results/bridge-sweep-cpu.md`` and ``.json``);
``--only a,b`` runs some.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from bench.conftest import RESULTS_DIR, machine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CMD = "PYTHONPATH=. nice -n 19 .venv/bin/python -m bench.bridge_sweep"
PROMPTS = [[3, 17, 5, 9, 22], [11, 2], [40, 41, 42]]
NEW_TOKENS = 4
#: Config arguments beyond the generic shrink, where a class needs them.
EXTRA: dict[str, dict[str, Any]] = {
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "reformer": {"axial_pos_shape": [8, 8], "axial_pos_embds_dim": [32, 32]},
}


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:200]


def _build(model_type: str, root: Path) -> tuple[Path, Any]:
    import copy

    import torch
    import transformers

    from hf_tiny import swept_config

    config = swept_config(model_type, **EXTRA.get(model_type, {}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="eager"
    ).eval()
    path = root / model_type
    model.save_pretrained(path)
    return path, model


def _bridge(path: Path) -> tuple[int, list[list[int]], str]:
    from graphrunner_ref.cli import main as cli

    prompts = path / "prompts.ids"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    argv = [
        "generate", "--model", str(path), "--model-impl", "transformers", "--prompts",
        str(prompts), "--prompts-format", "ids", "--max-new-tokens", str(NEW_TOKENS),
        "--runner", "eager", "--capture-sizes", "1,2,4", "--check-padding", "--json",
    ]  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except BaseException:  # noqa: BLE001 - a crash out of the command is an outcome
            traceback.print_exc()
            rc = -1
    records = [json.loads(x) for x in out.getvalue().splitlines() if x.startswith("{")]
    tokens = [r["token_ids"] for r in sorted(records, key=lambda r: r["index"])]
    return rc, tokens, err.getvalue()


def sweep_one(model_type: str, root: Path) -> dict[str, Any]:
    """The outcome of ``model_type``: ``outcome``, ``why`` (one line) and
    ``class`` (the model class transformers builds)."""
    from graphrunner_ref.engine.workload import Request
    from hf_tiny import hf_greedy

    try:
        path, model = _build(model_type, root)
    except Exception as e:  # whatever transformers raises: the class is not built tiny
        return {"outcome": "not built", "why": _one_line(e)}
    name = type(model).__name__
    rc, tokens, err = _bridge(path)
    errors = [x for x in err.splitlines() if "error:" in x or "violation" in x]
    if rc == 2 and len(errors) == 1 and "Traceback" not in err and not tokens:
        why = errors[0].split("error: ", 1)[-1]
        return {"outcome": "refused", "why": why[:300], "class": name}
    try:  # the reference, where the bridge did not refuse
        trace = [Request(i, tuple(p), NEW_TOKENS) for i, p in enumerate(PROMPTS)]
        expected = hf_greedy(model, trace)
    except Exception as e:  # transformers' own generate fails on its tiny model
        return {"outcome": "not built", "why": f"transformers' generate: {_one_line(e)}",
                "class": name}  # fmt: skip
    want = [expected[i] for i in range(len(PROMPTS))]
    if rc != 0:
        tail = [x for x in err.splitlines() if x.strip()][-1:] or [""]
        why = (errors[0] if errors else tail[0])[:300]
        return {"outcome": "failed", "why": f"exit {rc}: {why}", "class": name}
    if tokens != want:
        return {
            "outcome": "failed",
            "why": f"tokens {tokens} != transformers' {want}",
            "class": name,
        }
    return {"outcome": "run", "why": "", "class": name}


def _worker(names: list[str], out: Path) -> None:
    """Sweep ``names`` in order, appending a ``start`` line then a result
    line (JSON) per architecture to ``out``."""
    import torch
    import transformers

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp, out.open("a") as f:
        for name in names:
            f.write(json.dumps({"start": name}) + "\n")
            f.flush()
            t0 = time.perf_counter()
            try:
                result = sweep_one(name, Path(tmp))
            except BaseException as e:  # noqa: BLE001 - one architecture's crash, recorded
                result = {"outcome": "failed", "why": f"sweep crashed: {_one_line(e)}"}
            result["seconds"] = round(time.perf_counter() - t0, 1)
            f.write(json.dumps({"model_type": name, **result}) + "\n")
            f.flush()


def _read(out: Path) -> tuple[dict[str, dict[str, Any]], str | None]:
    done: dict[str, dict[str, Any]] = {}
    current = None
    for line in out.read_text().splitlines():
        record = json.loads(line)
        if "start" in record:
            current = record["start"]
        else:
            done[record["model_type"]] = record
            current = None
    return done, current


def sweep(names: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Each of ``names`` in worker processes, at most ``timeout`` seconds each."""
    done: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sweep.jsonl"
        out.touch()
        while len(done) < len(names):
            rest = [n for n in names if n not in done]
            argv = [sys.executable, "-m", "bench.bridge_sweep", "--worker", str(out), *rest]
            proc = subprocess.Popen(
                argv,
                env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"},
            )
            started, current = time.monotonic(), None
            while True:
                time.sleep(0.5)
                now, running = _read(out)
                new = {k: v for k, v in now.items() if k not in done}
                for k, v in new.items():
                    done[k] = v
                    print(f"{k:28s} {v['outcome']:12s} {v['seconds']:6.1f}s {v['why'][:90]}")
                if running != current:
                    started, current = time.monotonic(), running
                exited = proc.poll() is not None
                if exited or (current and time.monotonic() - started > timeout):
                    if not exited:
                        proc.kill()
                        proc.wait()
                    if current and current not in done:
                        why = f"timed out after {timeout:.0f} s" if not exited else "worker died"
                        done[current] = {"model_type": current, "outcome": "failed", "why": why,
                                         "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
                        print(f"{current:28s} failed       {why}")
                        with out.open("a") as f:  # the next worker starts after it
                            f.write(json.dumps(done[current]) + "\n")
                    break
    return done


ORDER = ("run", "refused", "failed", "not built")


def report(done: dict[str, dict[str, Any]], total: int, wall: float) -> list[str]:
    counts = Counter(r["outcome"] for r in done.values())
    lines = [
        "# Every transformers causal LM through the bridge",
        "",
        f"- command: `{CMD}`",
        *(f"- {k}: {v}" for k, v in machine().items()),
        f"- {total} architectures (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), {wall / 60:.1f} min",
        "- each: a tiny random checkpoint, `generate --model-impl transformers --runner eager "
        "--capture-sizes 1,2,4 --check-padding --json`, 3 prompts of 2-5 tokens, "
        f"{NEW_TOKENS} greedy tokens, against transformers' greedy `generate` of each alone",
        "",
        "| outcome | count |",
        "|---|---|",
        *(f"| {o} | {counts.get(o, 0)} |" for o in ORDER),
        "",
        "| model_type | model class | outcome | why | s |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(done):
        r = done[name]
        why = r["why"].replace("|", "\\|")
        lines.append(f"| {name} | {r.get('class', '')} | {r['outcome']} | {why} | {r['seconds']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated model types (default: every one)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per architecture")
    parser.add_argument("--out", default="bridge-sweep-cpu", help="results file name")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker[1:], Path(args.worker[0]))
        return 0
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    t0 = time.perf_counter()
    done = sweep(names, args.timeout)
    wall = time.perf_counter() - t0
    lines = report(done, len(names), wall)
    out = RESULTS_DIR / f"{args.out}.md"
    out.write_text("\n".join(lines) + "\n")
    payload = {"command": CMD, "machine": machine(), "wall_s": wall, "results": done}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(lines[:16]))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
