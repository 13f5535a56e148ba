"""What ``import graphrunner`` reads: the package's modules it loads and their lines.

PYTHONPATH=. .venv/bin/python -m bench.import_lines
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CODE = "import json, sys, graphrunner; print(json.dumps(sorted(sys.modules)))"


def loaded_lines() -> tuple[int, int]:
    """(modules, lines) of graphrunner that a bare import loads, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    root = Path(__file__).resolve().parents[1]
    ours = [m for m in json.loads(out.stdout) if m.split(".")[0] == "graphrunner"]
    files = [root / (m.replace(".", "/") + ".py") for m in ours]
    files = [f if f.exists() else f.with_suffix("") / "__init__.py" for f in files]
    return len(files), sum(len(f.read_text().splitlines()) for f in files)


if __name__ == "__main__":
    modules, lines = loaded_lines()
    print(f"import graphrunner: {modules} modules, {lines} lines")
