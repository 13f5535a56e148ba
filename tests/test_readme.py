"""The README's and the docs pages' examples run as written: every ``python``
block, among them the usage example over the reference model (with the eager
runner, so the test does not compile graphs), whose replays pass the
sanitizer, and the own-model page's block, which is ``examples/own_model.py``
word for word. The README is the integrator's page: at most 250 lines, the
four contracts each with its section, every relative link of every page
pointing at a file that exists."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

import graphrunner
import graphrunner_ref

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The pages whose blocks the tests run: the README and every docs page but
#: the design notes.
PAGES = [README, *sorted(p for p in DOCS.glob("*.md") if p.name != "design.md")]
EXAMPLE = ROOT / "examples" / "own_model.py"
#: The modules whose ``__all__`` is public: the package and its subpackages.
PUBLIC_MODULES = (
    "graphrunner",
    *(
        f"graphrunner.{name}"
        for name in (
            "pools",
            "declare",
            "batch",
            "writers",
            "sanitizer",
            "sampling",
            "sizing",
            "mechanisms",
            "core",
            "phases",
            "util",
        )
    ),
)
CONTRACTS = (
    "### 1. Declare your buffers and their pad rules",
    "### 2. Your step is checked once, where it is made",
    "### 3. Your attention backend implements the `GraphBackend` hooks",
    "### 4. Your pools reserve slot 0",
)


def _python_blocks(pages: list[Path] = PAGES) -> list[tuple[Path, str]]:
    return [
        (page, block)
        for page in pages
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    ]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_model", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pages_are_found() -> None:
    names = {p.name for p in PAGES}
    assert "README.md" in names and "design.md" not in names
    assert len(PAGES) > 10, "the docs pages moved out of the README"


def test_readme_usage_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocks = [(p, b) for p, b in _python_blocks() if b != EXAMPLE.read_text()]
    usage = [(p, b) for p, b in blocks if "create_runner" in b]
    assert len(usage) == 1, "expected one usage example in the README and docs pages"
    for page, block in blocks:
        if block is not usage[0][1]:
            exec(compile(block, str(page), "exec"), {})
    monkeypatch.setattr(graphrunner, "best_runner_kind", lambda: "eager")
    scope: dict[str, object] = {}
    exec(compile(usage[0][1], str(usage[0][0]), "exec"), scope)
    runner = scope["runner"]
    assert isinstance(runner, graphrunner.GraphRunner) and runner.kind == "eager"
    assert runner.stats.replays == 4 and runner.stats.padded_rows == 4  # 3 rows -> graph of 4
    assert runner.sanitizer is not None and runner.sanitizer.stats.replays_checked == 4
    assert "total" in capsys.readouterr().out


def test_readme_has_python_blocks_for_the_contracts() -> None:
    """Each contract's excerpt is a block that runs (the test above runs it)."""
    blocks = [b for _, b in _python_blocks([README])]
    for needle in ("decode_buffer_specs", "SpecBatch", "GraphBackend", "ReqToTokenPool"):
        assert any(needle in b for b in blocks), needle


def _imports(block: str, package: str) -> list[str]:
    return [
        line.strip()
        for line in block.splitlines()
        if re.match(rf"\s*(from|import) {package}\b", line)
    ]


def _imported_names(line: str) -> list[str]:
    """The names of ``from X import a, b`` (parenthesised over lines: the
    first line only carries what it carries; blocks here keep one line)."""
    match = re.match(r"from \S+ import \(?([^)]*)\)?", line)
    if match is None:
        return []
    return [n.strip().split(" as ")[0] for n in match.group(1).split(",") if n.strip()]


#: The reference's packages a docs page may import from (their ``__all__``).
REFERENCE_PUBLIC_MODULES = {"graphrunner_ref.bridge"}


def test_readme_examples_import_only_the_public_api() -> None:
    """Everything an integrator needs is importable from ``graphrunner`` itself:
    ``__all__`` is the contract, and the README's examples prove it. The docs
    pages may import a public subpackage's names (each in its ``__all__``) and
    the reference engine's (in ``graphrunner_ref.__all__``, or the bridge's in
    ``graphrunner_ref.bridge.__all__``), nothing deeper."""
    deep = [
        line
        for _, block in _python_blocks([README])
        for line in _imports(block, "graphrunner")
        if re.match(r"(from|import) graphrunner\.", line)
    ]
    assert deep == []
    assert sorted(graphrunner.__all__) == sorted(set(graphrunner.__all__))
    missing = [name for name in graphrunner.__all__ if not hasattr(graphrunner, name)]
    assert missing == []
    wrong = []
    for page, block in _python_blocks():
        text = block.replace("(\n", "(").replace(",\n", ", ")  # one line per import
        for line in _imports(text, "graphrunner") + _imports(text, "graphrunner_ref"):
            module_name = line.split()[1]
            if module_name == "graphrunner_ref":
                module: ModuleType = graphrunner_ref
            elif module_name in PUBLIC_MODULES or module_name in REFERENCE_PUBLIC_MODULES:
                module = importlib.import_module(module_name)
            else:
                wrong.append(f"{page.name}: {line} (not a public module)")
                continue
            public = getattr(module, "__all__", None)
            if public is None:
                wrong.append(f"{page.name}: {line} (no __all__)")
                continue
            wrong += [
                f"{page.name}: {line} ({n})" for n in _imported_names(line) if n not in public
            ]
    assert wrong == []


def test_the_own_model_section_is_the_example_file() -> None:
    assert [b for _, b in _python_blocks()].count(EXAMPLE.read_text()) == 1


def test_the_own_model_example_replays_padded_equal_to_eager(
    capsys: pytest.CaptureFixture[str],
) -> None:
    worst = _example().main("eager")
    assert worst < 1e-5
    out = capsys.readouterr().out
    assert "replays=4" in out and "live_rows=12" in out and "padded_rows=4" in out


def test_the_own_model_example_on_the_cpu_runner() -> None:
    assert _example().main("cpu") < 1e-5


def test_the_own_model_sanitizer_catches_a_padded_row_writing_live_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The example's guard can fail: a forward whose padded row writes row 4
    (a request outside the batch) instead of the sink row 0, at the batch's
    last position, is stopped at the first replay where that changes a value."""
    example = _example()

    def stray(self: torch.nn.Module, b: graphrunner.BufferView) -> torch.Tensor:
        padded = b.req_pool_indices == 0
        rows = torch.where(padded, 4, b.req_pool_indices)
        positions = torch.where(padded, b.positions.max(), b.positions)
        self.history[rows, positions] = self.embed(b.input_ids)
        return self.head(self.history[b.req_pool_indices].sum(1))

    monkeypatch.setattr(example.BagOfTokens, "forward", stray)
    with pytest.raises(graphrunner.PaddingViolation, match="history"):
        example.main("eager")


def test_the_readme_is_the_integrators_page() -> None:
    """At most 250 lines: what it is, install, the quick start, then the four
    contracts in order, each its own section, the example linked."""
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:3] == ["## Install", "## Quick start", "## Integrate with your engine"]
    positions = [text.find(c) for c in CONTRACTS]
    assert -1 not in positions, [c for c, i in zip(CONTRACTS, positions, strict=True) if i == -1]
    assert positions == sorted(positions)
    assert text.find("## Integrate with your engine") < positions[0]
    assert "](examples/own_batch.py)" in text


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", [*PAGES, DOCS / "design.md"], ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such heading)")
    assert broken == []


def test_the_readme_links_every_docs_page() -> None:
    text = README.read_text()
    unlinked = [p.name for p in DOCS.glob("*.md") if f"](docs/{p.name})" not in text]
    assert unlinked == []
