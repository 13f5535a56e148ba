"""The library stands apart: a bare ``import graphrunner`` loads the library
alone, its ``__all__`` is what an integrator needs, and the reference engine
(``graphrunner_ref``) reaches the library through public names only."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import graphrunner
import graphrunner_ref

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = Path(graphrunner.__file__).parent
REFERENCE = Path(graphrunner_ref.__file__).parent

#: The library's public subpackages: each lists its names in ``__all__``.
PUBLIC_SUBPACKAGES = (
    "batch",
    "core",
    "declare",
    "mechanisms",
    "phases",
    "pools",
    "sampling",
    "sanitizer",
    "sizing",
    "util",
    "writers",
)
PUBLIC_MODULES = {"graphrunner", "graphrunner.testing"} | {
    f"graphrunner.{name}" for name in PUBLIC_SUBPACKAGES
}


def _loaded_after_bare_import() -> list[str]:
    code = "import json, sys, graphrunner; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded: list[str] = json.loads(done.stdout)
    return loaded


def test_a_bare_import_loads_the_library_alone():
    loaded = _loaded_after_bare_import()
    reference = [m for m in loaded if m.split(".")[0] == "graphrunner_ref"]
    assert reference == []
    assert "transformers" not in loaded
    assert not [m for m in loaded if m.split(".")[0] in {"gguf", "tokenizers", "safetensors"}]
    ours = [m for m in loaded if m.split(".")[0] == "graphrunner"]
    assert "graphrunner.core.runner" in ours  # the test reads what it claims to


def test_a_bare_import_reads_at_most_ten_thousand_lines():
    """What an engine pays to import the library: the fused Triton writer and
    the reference stay unloaded until used."""
    package = Path(graphrunner.__file__).parent
    ours = [m for m in _loaded_after_bare_import() if m.split(".")[0] == "graphrunner"]
    files = [package.parent / (m.replace(".", "/") + ".py") for m in ours]
    files = [f if f.exists() else f.with_suffix("") / "__init__.py" for f in files]
    lines = sum(len(f.read_text().splitlines()) for f in files)
    assert "graphrunner.writers.fused" not in ours
    assert 5_000 < lines <= 10_000, f"import graphrunner reads {lines} lines of {len(ours)} modules"


def test_all_is_small_resolves_and_keeps_no_alias():
    names = graphrunner.__all__
    assert len(names) <= 30
    assert len(set(names)) == len(names)
    objects = {name: getattr(graphrunner, name) for name in names}
    by_identity: dict[int, list[str]] = {}
    for name, obj in objects.items():
        by_identity.setdefault(id(obj), []).append(name)
    assert [group for group in by_identity.values() if len(group) > 1] == []
    for name, obj in objects.items():
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__name__ == name, f"{name} is an alias of {obj.__name__}"


@pytest.mark.parametrize("old", ["StepInputs", "DecodeInputs"])
def test_the_old_protocol_names_still_resolve_with_a_warning_naming_the_steps(old: str):
    assert old not in graphrunner.__all__
    with pytest.warns(
        DeprecationWarning, match=r"takes a graphrunner.DecodeBatch or a graphrunner.SpecBatch"
    ):
        protocol = getattr(graphrunner, old)
    batch = graphrunner.DecodeBatch.empty("cpu", 8)
    assert isinstance(batch, protocol)  # what a replay reads: both steps have it


@pytest.mark.parametrize("name", PUBLIC_SUBPACKAGES)
def test_each_public_subpackage_lists_what_it_exports(name: str):
    module = importlib.import_module(f"graphrunner.{name}")
    exported = module.__all__
    assert exported and len(set(exported)) == len(exported)
    assert [n for n in exported if not hasattr(module, n)] == []


def test_create_runner_shows_its_arguments():
    params = inspect.signature(graphrunner.create_runner).parameters
    assert {"kind", "step", "specs", "device", "capture_sizes", "sanitizer"} <= set(params)
    assert not any(p.kind is p.VAR_KEYWORD or p.kind is p.VAR_POSITIONAL for p in params.values())


def _graphrunner_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every import of graphrunner in ``path`` (function-local and
    TYPE_CHECKING ones too): (line, module, names imported from it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "graphrunner":
                found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "graphrunner":
                    found.append((node.lineno, alias.name, []))
    return found


def test_the_reference_imports_the_library_through_public_names_only():
    offenders = []
    for path in sorted(REFERENCE.rglob("*.py")):
        where = path.relative_to(ROOT)
        for line, module, names in _graphrunner_imports(path):
            if module not in PUBLIC_MODULES:
                offenders.append(f"{where}:{line}: private module {module}")
                continue
            public = set(importlib.import_module(module).__all__)
            offenders += [
                f"{where}:{line}: {module}.{n} is not in its __all__"
                for n in names
                if n not in public
            ]
    assert offenders == []


def test_the_public_rule_fails_on_a_private_import(tmp_path: Path):
    # The rule above reads what it should: a private import is seen.
    planted = tmp_path / "planted.py"
    planted.write_text("from graphrunner.core.replay import launch_padded\n")
    assert [m for _, m, _ in _graphrunner_imports(planted)] == ["graphrunner.core.replay"]


def test_the_library_never_imports_the_reference():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(LIBRARY.rglob("*.py"))
        if path.name != "__main__.py"  # `python -m graphrunner` runs the reference's CLI
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom | ast.Import)
        for line, module in _modules_of(node)
        if module.split(".")[0] == "graphrunner_ref"
    ]
    assert offenders == []


def _modules_of(node: ast.ImportFrom | ast.Import) -> list[tuple[int, str]]:
    if isinstance(node, ast.ImportFrom):
        return [(node.lineno, node.module or "")]
    return [(node.lineno, a.name) for a in node.names]


def test_the_command_line_runs_from_both_packages():
    for module in ("graphrunner", "graphrunner_ref"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        for command in ("demo", "generate", "sizes", "convert"):
            assert command in done.stdout
