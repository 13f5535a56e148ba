"""Every command in the ``sh`` code blocks of the README and of the pages
under ``docs/`` (all but ``design.md``) runs as written.

Each block runs as one script (``bash -euo pipefail``) in a fresh shell, its
commands in order, and must exit 0. The shell starts in a scratch copy of the
repository root (its top-level entries linked, ``.venv`` the environment
running the tests, ``PATH`` with ``.venv/bin`` first as after
``. .venv/bin/activate``), so files a command writes land there, never in
the checkout.

The rule for what runs when: a block runs in the default suite unless the
line right before its fence is a marker ``<!-- commands: KIND -->``:

- ``quick-start``: the ``make`` targets of the README's quick start (one
  block, in the README only); never run here.
- ``slow``: longer than a few seconds on a CPU (captures that compile, a
  whole demo); runs with a longer time limit.
- ``gpu``: needs a CUDA device (``--runner cuda``, ``--model 1.1b``, the GPU
  benches); runs only on one.
- ``manual (why)``: needs what the suite does not have (the network, a
  checkpoint of your own); never run, the reason says why.

The default blocks take a few seconds each; the test checks that every block
is marked consistently (a GPU command only in a ``gpu`` block, a network one
only in a ``manual`` one).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages whose commands run: the README and every docs page but the
#: design notes.
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")]
KINDS = ("default", "quick-start", "slow", "gpu", "manual")
GPU_COMMANDS = re.compile(r"--runner cuda|--model 1\.1b|bench_gpu|bench_replay_host(?! --cpu)")
NETWORK_COMMANDS = re.compile(r"pip install|pip download|curl |wget |\.gguf\b|hf download")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the fence's line in the page, 1-based
    kind: str
    script: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}:{self.kind}"


def page_blocks(page: Path) -> list[Block]:
    """Every ``sh`` block of ``page`` with its marker's kind."""
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() not in ("```sh", "```bash", "```shell"):
            continue
        marker = re.fullmatch(r"<!-- commands: ([a-z-]+)( \(.+\))? -->", lines[i - 1].strip())
        kind = marker.group(1) if marker else "default"
        end = lines.index("```", i + 1)
        blocks.append(Block(page, i + 1, kind, "\n".join(lines[i + 1 : end]) + "\n"))
    return blocks


def readme_blocks() -> list[Block]:
    """Every ``sh`` block of the README and the docs pages, page by page."""
    return [block for page in PAGES for block in page_blocks(page)]


BLOCKS = readme_blocks()


def test_every_block_is_marked_by_the_rule() -> None:
    assert [b for b in BLOCKS if b.kind not in KINDS] == []
    assert [b.kind for b in BLOCKS].count("quick-start") == 1
    assert [b.page for b in BLOCKS if b.kind == "quick-start"] == [README]
    assert [b.id for b in BLOCKS if b.kind == "manual" and not _reason(b)] == []
    assert [b.id for b in BLOCKS if GPU_COMMANDS.search(b.script) and b.kind != "gpu"] == []
    assert [b.id for b in BLOCKS if NETWORK_COMMANDS.search(b.script) and b.kind != "manual"] == []
    assert any(b.kind == "default" for b in BLOCKS)


def _reason(block: Block) -> str:
    """The ``(why)`` of a block's marker."""
    lines = block.page.read_text().splitlines()
    marker = re.fullmatch(r"<!-- commands: [a-z-]+ \((.+)\) -->", lines[block.line - 2].strip())
    return marker.group(1) if marker else ""


def test_the_docs_pages_have_blocks_of_their_own() -> None:
    """The blocks moved with their sections: the README keeps the quick start
    and the install, the pages the rest."""
    assert len(PAGES) > 1 and all(p.exists() for p in PAGES)
    assert any(b.page != README and b.kind == "default" for b in BLOCKS)
    assert {b.page for b in BLOCKS} > {README}


def _scratch(tmp_path: Path) -> Path:
    """A directory that looks like the repository root after the quick start."""
    for entry in ROOT.iterdir():
        if entry.name not in (".venv", ".git"):
            (tmp_path / entry.name).symlink_to(entry)
    # The environment running the tests (.venv, or .venv-latest under make test-latest).
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    return tmp_path


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if block.kind in ("quick-start", "manual"):
        pytest.skip(f"{block.kind}: not run by the suite")
    if block.kind == "gpu" and not torch.cuda.is_available():
        pytest.skip("gpu: needs a CUDA device")
    cwd = _scratch(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{cwd / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        # This checkout's package, whichever checkout the environment was installed from.
        "PYTHONPATH": str(ROOT),
        "GRAPHRUNNER_CACHE": str(tmp_path / "cache"),
        "GRAPHRUNNER_RESULTS_DIR": str(tmp_path / "results"),  # a bench's file, not the checkout's
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120 if block.kind == "default" else 900,
    )
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{done.stderr[-3000:]}"
