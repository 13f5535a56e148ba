"""The code's shape holds: one declared field list drives the decode batch,
protocols and buffers; no import cycle inside the package; no module reaches
into another's private attributes; no hard-coded warning stack levels."""

from __future__ import annotations

import ast
import importlib
import re
import typing
from pathlib import Path

import pytest
import torch

import graphrunner
import graphrunner_ref
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.declare import DECODE_FIELDS, DECODE_HOST_MIRRORS
from graphrunner.declare.decode import DECODE_FIELD_NAMES, decode_buffer_specs
from graphrunner.declare.inputs import StepInputs
from graphrunner.testing import ToyWorld
from poison import stale_values

PACKAGE = Path(graphrunner.__file__).parent
REFERENCE = Path(graphrunner_ref.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py")) + sorted(REFERENCE.rglob("*.py"))


def _protocol_attributes(proto: type) -> set[str]:
    names = set(typing.get_type_hints(proto))
    return names | {n for n, v in vars(proto).items() if isinstance(v, property)}


def test_the_decode_field_list_drives_protocols_batch_buffers_and_poison():
    fields = set(DECODE_FIELD_NAMES)
    mirrors = set(DECODE_HOST_MIRRORS.values())
    assert set(DECODE_HOST_MIRRORS) <= fields
    assert _protocol_attributes(StepInputs) == mirrors | {"batch_size"}
    derived = {"sealed", "seal_key", "batch_size", "host_ranges"}
    assert set(DecodeBatch.__slots__) == fields | mirrors | derived | {"device", "max_context_len"}
    assert set(typing.get_type_hints(DecodeBatch)) == fields | mirrors | derived
    assert [s.name for s in decode_buffer_specs()] == [s.name for s in DECODE_FIELDS]
    world = ToyWorld()
    batch = world.make_batch(2, seed=0)
    assert set(stale_values(world, batch)) == fields
    assert isinstance(batch, StepInputs)


def test_filter_and_merge_carry_every_declared_field():
    world = ToyWorld()
    batch = world.make_batch(3, seed=1)
    before = {n: getattr(batch, n).clone() for n in DECODE_FIELD_NAMES}
    before_host = {n: getattr(batch, n).clone() for n in DECODE_HOST_MIRRORS.values()}
    batch.filter([2, 0])
    for name in DECODE_FIELD_NAMES:
        assert torch.equal(getattr(batch, name), before[name][[2, 0]]), name
    for name in DECODE_HOST_MIRRORS.values():
        assert torch.equal(getattr(batch, name), before_host[name][[2, 0]]), name
    tail = DecodeBatch.empty("cpu", world.cfg.max_context_len)
    batch.merge(tail)
    assert batch.batch_size == 2


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, type_only_too: bool = False) -> set[str]:
    """graphrunner modules ``path`` imports, anywhere in it (function-local
    imports included: a lazy import hides a cycle, it does not remove it),
    TYPE_CHECKING-only imports left out unless ``type_only_too``."""
    known = {_module_name(p) for p in MODULES}
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for node in ast.walk(tree)
        if not type_only_too
        and isinstance(node, ast.If)
        and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module in known:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found


@pytest.mark.parametrize("type_only_too", [False, True], ids=["runtime", "with-type-only"])
def test_no_import_cycle_inside_the_package(type_only_too: bool):
    """No cycle, not even through a TYPE_CHECKING import (a type-only import
    hides a cycle of concepts, it does not remove it)."""
    graph = {_module_name(p): _imports(p, type_only_too=type_only_too) for p in MODULES}
    graph.pop("graphrunner")  # the public API imports everything; the library never imports it
    graph.pop("graphrunner_ref")
    library = {m: deps for m, deps in graph.items() if m.split(".")[0] == "graphrunner"}
    assert not any({"graphrunner", "graphrunner_ref"} & deps for deps in library.values())
    assert not any("graphrunner_ref" in deps for deps in graph.values())
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        assert module not in visiting, f"import cycle: {' -> '.join([*visiting, module])}"
        if module in done:
            return
        visiting.append(module)
        for dep in sorted(graph.get(module, ())):
            visit(dep)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def _imported_roots(tree: ast.AST) -> set[str]:
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and not node.module.startswith("graphrunner")
        ):
            roots |= {a.asname or a.name for a in node.names}
    return roots


def _private_names_defined(tree: ast.AST) -> set[str]:
    """Private methods and ``self._x`` attributes this module's classes define."""
    names = {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("_")
    }
    return names | {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr.startswith("_")
    }


def test_no_module_reaches_into_another_objects_private_attributes():
    """``obj._name`` only on ``self``/``cls``, on an object of a class the same
    module defines, or on third-party modules (torch's private API is torch's
    business, pinned by the tests)."""
    offenders = []
    for path in MODULES:
        tree = ast.parse(path.read_text())
        external = _imported_roots(tree)
        own = _private_names_defined(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__") or node.attr in own:
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in {"self", "cls", *external}:
                continue
            offenders.append(
                f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}"
            )
    assert offenders == []


def test_no_hard_coded_warning_stack_levels():
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}:{node.lineno}"
        for p in MODULES
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.keyword)
        and node.arg == "stacklevel"
        and isinstance(node.value, ast.Constant)
    ]
    assert offenders == []


#: The layers, lowest first: a module may import its own layer and the ones
#: below it, never one above (the table ``docs/design.md`` draws). The top
#: level (``graphrunner/__init__.py``, ``__main__``, ``testing``) sits above all.
LAYERS = (
    "util",
    "pools",
    "declare",
    "sampling",
    "batch",
    "writers",
    "sanitizer",
    "sizing",
    "mechanisms",
    "core",
    "phases",
    "model",
    "io",
    "bridge",
    "engine",
    "serve",
    "cli",
)
TOP_LEVEL = {
    "graphrunner",
    "graphrunner.__main__",
    "graphrunner.testing",
    "graphrunner_ref",
    "graphrunner_ref.__main__",
}


def _is_reference(module: str) -> bool:
    return module.split(".")[0] == "graphrunner_ref"


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_every_module_sits_in_a_layer_and_the_top_level_stays_small():
    top = {m for m in map(_module_name, MODULES) if m.count(".") <= 1 and m not in TOP_LEVEL}
    assert {_layer(m) for m in top} <= set(LAYERS), "a module outside every layer"
    loose = [p for p in PACKAGE.glob("*.py")]
    assert len(loose) <= 8, f"{len(loose)} modules at the top of graphrunner/"


def test_no_module_imports_a_layer_above_its_own():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in MODULES:
        module = _module_name(path)
        if module in TOP_LEVEL:
            continue
        for dep in _imports(path):
            if _is_reference(module) and not _is_reference(dep) and dep != "graphrunner.__main__":
                continue  # the reference stands on the library (through public names)
            if dep in TOP_LEVEL or rank[_layer(dep)] > rank[_layer(module)]:
                upward.append(f"{module} -> {dep}")
    assert upward == []


def test_no_private_name_is_imported_from_another_module():
    """A ``_name`` stays in its module: what modules share is public."""
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {alias.name} from {node.module}"
        for path in MODULES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.split(".")[0] in {"graphrunner", "graphrunner_ref"}
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert offenders == []


def test_the_decode_field_names_are_written_in_one_place():
    """Each decode field's name is a string literal in ``declare/decode.py``
    only; every other library module imports its constant (docstrings and
    f-string text aside)."""
    declared = PACKAGE / "declare" / "decode.py"
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == declared:
            continue
        tree = ast.parse(path.read_text())
        text = {
            id(n) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for n in node.values
        } | {
            id(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        }
        offenders += [
            f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and node.value in DECODE_FIELD_NAMES
            and id(node) not in text
        ]
    assert offenders == []


#: The runners known by name: each is ``create_runner`` with one thing fixed.
CARD_RUNNERS = {"CudaGraphRunner", "CpuGraphRunner", "EagleDraftExtendRunner", "FrozenKvMtpRunner"}
#: The public types that describe a step's inputs: the two steps a replay
#: takes (each validated where it is made), and what a forward reads.
INPUT_TYPES = {"BufferView", "DecodeBatch", "SpecBatch"}


def _library_trees() -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _runner_classes(trees: list[tuple[Path, ast.Module]]) -> dict[str, ast.ClassDef]:
    """Every class of the library that derives from GraphRunner, by name."""
    found: dict[str, ast.ClassDef] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base).split(".")[-1] in {"GraphRunner", *found} for base in node.bases
            ):
                found[node.name] = node
    return found


def test_create_runner_is_the_one_way_to_build_a_runner():
    """A runner is built by ``create_runner``: ``GraphRunner(...)`` is called
    nowhere else, the named runners only fix one of its arguments (a body of
    ``__init__`` alone, handing ``runner_parts`` to the base), no other
    function returns a new runner, and the reference calls no runner class."""
    trees = _library_trees()
    classes = _runner_classes(trees)
    assert set(classes) == CARD_RUNNERS | {"_KindBound"}, "a runner class that binds nothing"
    for name, node in classes.items():
        members = [n for n in node.body if not isinstance(n, ast.Expr)]  # the docstring
        if [ast.unparse(m) for m in members] in (["fixed_kind = 'cuda'"], ["fixed_kind = 'cpu'"]):
            continue  # a kind binding: _KindBound with its kind
        inits = [m for m in members if getattr(m, "name", None) == "__init__"]
        assert len(inits) == 1 and len(members) - len(inits) <= 1, name  # + _KindBound's hint
        assert "super().__init__(*runner_parts(" in ast.unparse(inits[0]), name
    builders = []
    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "GraphRunner":
                builders.append(f"{path.name}: GraphRunner(...)")
            if isinstance(node, ast.FunctionDef) and node.returns is not None:
                returns = ast.unparse(node.returns).strip("'\"")
                if returns == "GraphRunner" and node.name != "create_runner":
                    builders.append(f"{path.name}: {node.name} -> GraphRunner")
    assert builders == ["create.py: GraphRunner(...)"]
    reference_calls = [
        f"{path.relative_to(REFERENCE)}:{node.lineno}"
        for path in sorted(REFERENCE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and ast.unparse(node.func).split(".")[-1] in CARD_RUNNERS | {"GraphRunner"}
    ]
    assert reference_calls == [], "the reference builds a runner past create_runner"


def _public_names() -> list[tuple[str, object]]:
    """Every name of ``graphrunner.__all__`` and of each public subpackage's."""
    modules = [graphrunner] + [
        importlib.import_module(f"graphrunner.{p.name}")
        for p in sorted(PACKAGE.iterdir())
        if (p / "__init__.py").exists()
    ]
    return [(n, getattr(m, n)) for m in modules for n in getattr(m, "__all__", [])]


def test_two_public_steps_and_a_view_describe_a_steps_inputs():
    found = {
        name
        for name, value in _public_names()
        if isinstance(value, type) and re.search(r"(Inputs|Batch|View|Tensors|Rows)$", name)
    }
    assert found == INPUT_TYPES
