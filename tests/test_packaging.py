"""The package installs and imports with its core dependencies alone: the
optional ones (``[text]``, ``[gguf]``, ``[cuda]``, ``[plots]``, ``[serve]``,
``[structured]``) are imported
only where a feature uses them, and a missing one names the extra to
install. Plus the version, one string in one place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import graphrunner
import graphrunner_ref
from graphrunner.util.extras import EXTRAS, MissingExtraError, needs_extra
from graphrunner.util.version import VERSION

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = sorted({m for modules in EXTRAS.values() for m in modules} | {"matplotlib"})

#: Prepended to each child's code: importing any optional module fails as if
#: it were not installed (a finder ahead of the real ones refuses it).
BLOCK = f"""
import importlib.abc, sys
class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Refuse())
for _name in list(sys.modules):
    if _name.partition(".")[0] in {OPTIONAL!r}:
        del sys.modules[_name]
"""


#: What the child does with the optional packages refused, in one process
#: (importing torch is most of a child's time): import, ``--help``,
#: ``--version``, text through the CLI, and each optional feature.
CHILD = """
import contextlib, io, json
report = {}
import graphrunner
from graphrunner_ref.cli.main import main
from graphrunner.util.extras import MissingExtraError
for argv in (["--help"], ["generate", "--help"], ["convert", "--help"], ["--version"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            report[" ".join(argv)] = [e.code, out.getvalue()]
report["leaked"] = sorted({m.partition(".")[0] for m in sys.modules} & set(%(optional)r))
err = io.StringIO()
with contextlib.redirect_stderr(err):
    rc = main(["generate", "--checkpoint", %(checkpoint)r, "--prompt", "hi", "--runner", "eager"])
report["text"] = [rc, err.getvalue()]
for name, call in %(calls)r.items():
    try:
        exec(call)
        report[name] = "no error"
    except MissingExtraError as e:
        report[name] = str(e)
print(json.dumps(report))
"""

#: A feature of each extra, called with its packages refused.
CALLS = {
    "gguf": "from graphrunner_ref.io.gguf_meta import open_gguf; open_gguf('x.gguf')",
    "fused interpreted": "from graphrunner.writers.fused_kernel import kernel; kernel(True)",
    "fused": "from graphrunner.writers.fused_kernel import kernel; kernel(False)",
    "attention": "from graphrunner_ref.model.kernels.decode_attention import _kernels; _kernels(False)",
    "structured": "from graphrunner_ref.serve.structured import Grammars; "
    "Grammars.__new__(Grammars)._build()",
}
#: The extra each of :data:`CALLS` names.
CALL_EXTRAS = {"gguf": "gguf", "structured": "structured"}


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The child's report (see :data:`CHILD`)."""
    tmp = tmp_path_factory.mktemp("blocked")
    checkpoint = tmp / "tiny"  # the embedded model, with a tokenizer file
    graphrunner_ref.save_checkpoint(graphrunner_ref.default_model(max_requests=1).model, checkpoint)
    (checkpoint / "tokenizer.json").write_text("{}")
    code = CHILD % {"optional": OPTIONAL, "checkpoint": str(checkpoint), "calls": CALLS}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAPHRUNNER_CACHE": str(tmp / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", BLOCK + code],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


def test_import_help_and_version_need_no_optional_package(blocked: dict[str, Any]) -> None:
    assert blocked["leaked"] == []
    for argv in ("--help", "generate --help", "convert --help"):
        code, out = blocked[argv]
        assert code == 0 and out.startswith("usage: graphrunner"), argv
    assert blocked["--version"] == [0, f"graphrunner {VERSION}\n"]


def test_text_without_the_text_extra_names_it(blocked: dict[str, Any]) -> None:
    """``--prompt`` text on a checkpoint with a tokenizer: exit 2, one line
    naming the package and the extra, no traceback."""
    rc, err = blocked["text"]
    assert rc == 2
    assert err.startswith("graphrunner generate: error: --prompt needs the 'transformers' package")
    assert err.endswith("pip install 'graphrunner[text]'\n") and err.count("\n") == 1


@pytest.mark.parametrize(("name", "extra"), [(n, CALL_EXTRAS.get(n, "cuda")) for n in CALLS])
def test_each_optional_feature_names_its_extra(
    blocked: dict[str, Any], name: str, extra: str
) -> None:
    assert blocked[name].endswith(f"pip install 'graphrunner[{extra}]'")


def test_needs_extra_converts_only_its_own_modules() -> None:
    with pytest.raises(MissingExtraError, match=r"graphrunner\[plots\]"), needs_extra("plots", "x"):
        raise ModuleNotFoundError("No module named 'matplotlib.pyplot'", name="matplotlib.pyplot")
    with pytest.raises(ModuleNotFoundError) as info, needs_extra("text", "x"):
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")
    assert not isinstance(info.value, MissingExtraError)
    with pytest.raises(ValueError, match="extra='gpu'"), needs_extra("gpu", "x"):
        pass


def test_pyproject_core_and_extras_match_the_code() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    core = [r.split(">")[0].split("=")[0].strip() for r in project["project"]["dependencies"]]
    assert core == ["torch", "nvtx", "tqdm", "safetensors", "numpy"]
    extras = project["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        names = [r.split(">")[0].split(";")[0].strip() for r in extras[extra]]
        assert names == list(modules), extra
    assert extras["cuda"] == ["triton; sys_platform == 'linux'"]
    assert extras["all"] == ["graphrunner[text,gguf,cuda,plots,serve,structured]"]
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["dynamic"] == ["version"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "graphrunner.util.version.VERSION"}
    assert ".[all,test]" in (ROOT / "Makefile").read_text()


def test_version_is_the_distributions_or_the_source_trees() -> None:
    assert graphrunner.__version__ == VERSION  # the editable install of this tree
    assert "__version__" in graphrunner.__all__
