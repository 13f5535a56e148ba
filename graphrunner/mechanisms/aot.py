"""The CPU runner's one program saved ahead of time and loaded without tracing.

With ``aot_cache=DIR`` the CPU mechanism keeps its program in ``DIR`` as an
AOTInductor package (a shared library) beside a JSON manifest. The first
capture traces the forward once with dynamo (no inductor compile), exports
that graph with a symbolic batch dimension, compiles it with AOTInductor,
writes package and manifest to a temporary folder and renames the folder into
place (a reader sees the whole artifact or none). A later capture reads the
manifest, checks it and calls the library: no dynamo, no AOTAutograd, not
even their imports.

**What the program takes.** Every tensor the forward reads is an argument,
none a constant: the static buffers at the size captured and the model's own
tensors (weights, KV pools, tables), at their live addresses, so the program
writes the KV pools in place as the traced forward does. The manifest names
each argument by its path from the two roots the step is called with
(``forward`` and ``view``: attributes, items, closure cells), found at build
time by walking the objects the forward holds; a load resolves the paths again
and checks every tensor's dtype, device, shape and strides. A forward that
reads a tensor no path reaches, a graph break, or a branch on the batch that
some size up to the traced (largest) one would take otherwise cannot be
saved, nor a step that skips work through ``torch.cond`` (the sampled
step's gates: saved, it would do that work every step): the mechanism says
why, naming the guard or the gates (:attr:`AotPrograms.status`), and
compiles as without a cache. A branch every such size takes alike (a decode
runner's sizes all under ``--prefill-bf16``'s row threshold) is saved.

**The key** (:func:`key_fields`): torch's and graphrunner's versions, Python,
the machine and torch's CPU kernel level, the largest captured size (the one
program serves every size up to it), the static buffers' names, dtypes and
shapes, and the caller's fields (``aot_key``: the reference adds its model,
dtype, quantize mode and CPU feature path). The artifact's folder is named by
the key's hash; the manifest repeats the fields and a load compares each one,
and the package's length and SHA-256: any difference is refused with the field
named, and the program rebuilt, never run. A loaded program is run once at the
largest size and compared with the eager forward before any size uses it:
it may differ by twice what the build measured (the manifest's ``eager
deviation``; a step that quantizes its activations rounds differently
compiled), never by more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphrunner.declare.buffers import BufferView
from graphrunner.declare.outputs import Outputs
from graphrunner.mechanisms.base import ForwardFn, Launcher
from graphrunner.util.version import version
from graphrunner.util.warn import warn_at_caller

__all__ = ["FORMAT", "AotPrograms", "AotRefused", "key_fields"]

#: The manifest's layout; a manifest of another is refused.
FORMAT = 1
MANIFEST = "manifest.json"
PACKAGE = "step.pt2"
#: The message of a FutureWarning torch's export raises from its own code.
_TORCH_OWN_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
#: How far the walk for the forward's tensors goes (objects visited).
_WALK_LIMIT = 200_000
_ROOTS = ("forward", "view")


class AotRefused(RuntimeError):
    """A saved program that must not run (stale, foreign, damaged), or a
    forward that cannot be saved; the message says why."""


def key_fields(view: BufferView, max_size: int, extra: Mapping[str, str]) -> dict[str, str]:
    """What a saved program is keyed by (see the module's docstring)."""
    buffers = ",".join(
        f"{name}:{str(t.dtype).removeprefix('torch.')}:{list(t.shape[1:])}"
        for name, t in sorted(view.tensors().items())
    )
    fields = {
        "format": str(FORMAT),
        "torch": torch.__version__,
        "graphrunner": version(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
        "max size": str(max_size),
        "buffers": buffers,
    }
    for name, value in extra.items():
        if name in fields:
            raise ValueError(f"aot_key field {name!r} is the mechanism's own; name it otherwise")
        fields[name] = str(value)
    return fields


def _digest(fields: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- paths from the roots to each tensor ------------------------------------

_Step = tuple[str, Any]  # ("d", name) vars, ("a", name) slot, ("i", n), ("k", key), ("c", n) cell
_SKIP = (type, types.ModuleType, str, bytes, int, float, bool, complex, torch.dtype, torch.device)


def _children(obj: Any) -> Iterator[tuple[_Step, Any]]:
    if isinstance(obj, list | tuple):
        yield from ((("i", i), x) for i, x in enumerate(obj))
    elif isinstance(obj, dict):
        yield from ((("k", k), x) for k, x in obj.items() if isinstance(k, str | int))
    elif isinstance(obj, types.MethodType):
        yield ("a", "__self__"), obj.__self__
        yield ("a", "__func__"), obj.__func__
    elif isinstance(obj, types.FunctionType):
        for i, cell in enumerate(obj.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                yield ("c", i), cell.cell_contents
    else:
        for name, x in (getattr(obj, "__dict__", None) or {}).items():
            if isinstance(name, str):
                yield ("d", name), x
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    yield ("a", name), getattr(obj, name)


def _find_paths(roots: Mapping[str, Any], wanted: Sequence[torch.Tensor]) -> list[list[_Step]]:
    """The shortest path from ``roots`` to each tensor of ``wanted`` (by identity)."""
    ids = {id(t): i for i, t in enumerate(wanted)}
    found: dict[int, list[_Step]] = {}
    seen: set[int] = set()
    queue: list[tuple[Any, list[_Step]]] = [(obj, [("r", name)]) for name, obj in roots.items()]
    head = 0
    while head < len(queue) and len(found) < len(ids) and head < _WALK_LIMIT:
        obj, path = queue[head]
        head += 1
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if id(obj) in ids and ids[id(obj)] not in found:
                found[ids[id(obj)]] = path
            continue
        if isinstance(obj, _SKIP) or obj is None:
            continue
        queue.extend((child, [*path, step]) for step, child in _children(obj))
    missing = [i for i in range(len(wanted)) if i not in found]
    if missing:
        shapes = ", ".join(f"#{i} {tuple(wanted[i].shape)}" for i in missing[:4])
        raise AotRefused(
            f"the forward reads {len(missing)} tensor(s) no attribute path from forward or "
            f"view reaches ({shapes}); such a program cannot be saved"
        )
    return [found[i] for i in range(len(wanted))]


def _resolve(roots: Mapping[str, Any], path: Sequence[Sequence[Any]]) -> Any:
    obj: Any = None
    for kind, key in path:
        if kind == "r":
            obj = roots[key]
        elif kind == "d":
            obj = vars(obj)[key]
        elif kind == "a":
            obj = getattr(obj, key)
        elif kind == "i":
            obj = obj[int(key)]
        elif kind == "k":
            obj = obj[key]
        elif kind == "c":
            obj = obj.__closure__[int(key)].cell_contents
        else:
            raise KeyError(kind)
    return obj


def _spell(path: Sequence[Sequence[Any]]) -> str:
    out = ""
    for kind, key in path:
        out += str(key) if kind == "r" else f"[{key!r}]" if kind in "ik" else f".{key}"
    return out


# -- the program ------------------------------------------------------------


def _sym(value: object) -> str | None:
    """A symbolic size as its expression's text; None for a concrete one."""
    return str(value.node.expr) if isinstance(value, torch.SymInt) else None


#: The difference from the eager forward a load allows (in units of one plus
#: the output's largest magnitude), beside twice what the build measured.
_SLACK = 1e-4


def _scale(b: torch.Tensor) -> float:
    return 1.0 + float(b.float().nan_to_num(0, 0, 0).abs().max()) if b.numel() else 1.0


def _close(a: torch.Tensor, b: torch.Tensor, slack: float = _SLACK) -> bool:
    """Equal up to the order of float sums, or ``slack`` (NaN where the
    other has NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    atol = max(_SLACK, slack) * _scale(b)
    return torch.allclose(a.float(), b.float(), rtol=1e-3, atol=atol, equal_nan=True)


def _deviation(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """The largest difference of ``got``'s float outputs from ``expected``'s,
    each in units of one plus its expected largest magnitude."""
    worst = 0.0
    for a, b in zip(got, expected, strict=True):
        if a.is_floating_point() and a.shape == b.shape and a.numel():
            diff = (a.float() - b.float()).nan_to_num(0, 0, 0).abs().max()
            worst = max(worst, float(diff) / _scale(b))
    return worst


class _Flat(torch.nn.Module):
    """The traced graph over tensors only: each size argument read off a tensor."""

    def __init__(self, gm: torch.fx.GraphModule, ints: dict[int, Any], n_args: int) -> None:
        super().__init__()
        self.gm, self.ints, self.n_args = gm, ints, n_args

    def forward(self, *tensors: torch.Tensor) -> Any:
        it, args = iter(tensors), list[Any]()
        for i in range(self.n_args):
            args.append(None if i in self.ints else next(it))
        for i, rule in self.ints.items():
            args[i] = 0 if rule is None else args[rule[0]].shape[rule[1]]
        return self.gm(*args)


class AotPrograms:
    """The CPU mechanism's saved program: loads or builds it at the first
    (largest) size and launches it at every size. ``status`` says what
    happened: ``loaded``, ``built (why)``, ``refused (why)``.

    Args:
        cache_dir: where artifacts live, one folder per key.
        extra: the caller's key fields (``aot_key``).
        patches: inductor config patches for the AOTInductor compile.
        dynamic_batch: the mechanism's (False is refused: one program per
            size is not what is saved).

    Opt-in (``aot_cache=DIR``), not a default folder: the artifact is a shared
    library the process loads and runs, so where it may come from is the
    caller's choice (keep the folder as private as the code).
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None,
        extra: Mapping[str, str] | None,
        patches: Mapping[str, Any],
        dynamic_batch: bool = True,
    ) -> None:
        if cache_dir is None:
            raise ValueError("aot_key without aot_cache: name the cache folder")
        if not dynamic_batch:
            raise ValueError("aot_cache saves the one program of dynamic_batch=True")
        self.root = Path(cache_dir)
        self.extra = {str(k): str(v) for k, v in (extra or {}).items()}
        self.patches = {k: v for k, v in patches.items() if not k.startswith("triton.")}
        self.status: str | None = None
        #: The size whose capture loaded or built the program.
        self.first: int | None = None
        #: False once the forward could not be saved: the caller compiles.
        self.active = True
        self.compilations = 0
        self.cache_hits = 0
        self.recorded: Outputs | None = None
        self._loader: Any = None
        self._manifest: dict[str, Any] = {}
        self._model_args: dict[int, torch.Tensor] = {}
        self._checked: list[torch.Tensor] | None = None

    @property
    def folder(self) -> Path | None:
        """The artifact's folder (once the key is known)."""
        key = self._manifest.get("key")
        return None if key is None else self.root / _digest(key)

    # -- capture ----------------------------------------------------------

    def capture(
        self, bs: int, forward: ForwardFn, view: BufferView, *, part: str | None = None
    ) -> Launcher | None:
        """Size ``bs``'s launcher; at the first size, loads (or builds) the
        program. None where the forward cannot be saved (``status`` says why).
        ``part``: which part of a split step ``forward`` is (``head``), a key field."""
        if not self.active:
            return None
        if self._loader is None:
            self.first = bs
            extra = self.extra if part is None else {**self.extra, "part": part}
            key = key_fields(view, bs, extra)
            try:
                self._prepare(key, forward, view)
            except AotRefused as e:
                self.active, self.first = False, None
                self.status = f"refused ({e})"
                warn_at_caller(f"aot_cache: {e}; compiling without the cache")
                return None
        args = self._arguments(forward, view)
        run, spec, order = self._loader.run, self._spec(), self._manifest["outputs"]
        first, self._checked = self._checked, None  # a load's checked run is this size's
        self.recorded = pytree.tree_unflatten(first or self._pick(run(args), order), spec)
        return lambda: pytree.tree_unflatten(self._pick(run(args), order), spec)

    @staticmethod
    def _pick(flat: list[torch.Tensor], order: list[int]) -> list[torch.Tensor]:
        return [flat[i] for i in order]

    def _spec(self) -> Any:
        return pytree.treespec_loads(self._manifest["spec"])

    def _prepare(self, key: dict[str, str], forward: ForwardFn, view: BufferView) -> None:
        self._manifest = {"key": key}
        folder = self.folder
        assert folder is not None
        why = "none saved"
        if folder.exists():
            try:
                self._load(folder, key, forward, view)
                self.status = "loaded"
                self.compilations += 1
                self.cache_hits += 1
                return
            except AotRefused as e:
                why = f"refused: {e}"
                self._loader = None
                self._model_args.clear()
        self._build(folder, key, forward, view)
        self.status = f"built ({why})"
        self.compilations += 1

    def _load(
        self, folder: Path, key: dict[str, str], forward: ForwardFn, view: BufferView
    ) -> None:
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise AotRefused(f"manifest unreadable ({type(e).__name__})") from None
        saved = manifest.get("key") if isinstance(manifest, dict) else None
        if not isinstance(saved, dict):
            raise AotRefused("manifest has no key")
        for name in sorted(set(key) | set(saved)):
            if saved.get(name) != key.get(name):
                raise AotRefused(
                    f"{name} differs: saved {saved.get(name)!r}, here {key.get(name)!r}"
                )
        package = folder / PACKAGE
        try:
            size, sha = package.stat().st_size, _file_sha(package)
        except OSError:
            raise AotRefused("package missing") from None
        if size != manifest.get("package bytes") or sha != manifest.get("package sha256"):
            raise AotRefused("package damaged (its length or SHA-256 differs from the manifest)")
        self._manifest = manifest
        got, expected = self._beside_eager(package, forward, view)
        # As far from eager as the program was when built, with a margin: a
        # model whose activations are quantized inside the step (int4-q8)
        # rounds differently compiled than eager, where a wrong program
        # (other weights, a stale layout) is off by the outputs' own size.
        slack = 2 * float(manifest.get("eager deviation", 0.0))
        same = len(got) == len(expected) and all(
            _close(a, b, slack) for a, b in zip(got, expected, strict=True)
        )
        if not same:
            raise AotRefused("the loaded program's outputs differ from the eager forward's")
        self._checked = got

    def _open(self, package: Path) -> None:
        try:
            self._loader = torch._C._aoti.AOTIModelPackageLoader(
                str(package), "model", False, 1, -1
            )
        except RuntimeError as e:
            raise AotRefused(f"package does not load ({str(e).splitlines()[0]})") from None

    def _arguments(self, forward: ForwardFn, view: BufferView) -> list[torch.Tensor]:
        """The program's arguments at ``view``'s size, each checked against the manifest."""
        roots = {"forward": forward, "view": view}
        values: dict[str, int] = {}
        args = []
        for i, arg in enumerate(self._manifest["args"]):
            path = arg["path"]
            cached = self._model_args.get(i) if path[0][1] == "forward" else None
            t = cached if cached is not None else _resolve(roots, path)
            where = _spell(path)
            if not isinstance(t, torch.Tensor):
                raise AotRefused(f"{where} is no tensor here")
            if str(t.dtype) != arg["dtype"] or t.device.type != arg["device"]:
                raise AotRefused(f"{where} is {t.dtype} on {t.device}, saved {arg['dtype']}")
            if len(t.shape) != len(arg["shape"]):
                raise AotRefused(f"{where} has {t.dim()} dims, saved {len(arg['shape'])}")
            for d, (n, want) in enumerate(zip(t.shape, arg["shape"], strict=True)):
                if isinstance(want, int) and n != want:
                    raise AotRefused(f"{where} has shape {tuple(t.shape)}, saved {arg['shape']}")
                if isinstance(want, str) and values.setdefault(want, n) != n:
                    raise AotRefused(f"{where} dim {d} is {n}, {want} is {values[want]} here")
                stride = arg["stride"][d]
                if stride is not None and t.shape[d] > 1 and t.stride(d) != stride:
                    raise AotRefused(f"{where} has strides {t.stride()}, saved {arg['stride']}")
            if path[0][1] == "forward":
                self._model_args[i] = t
            args.append(t)
        return args

    # -- build ------------------------------------------------------------

    def _build(
        self, folder: Path, key: dict[str, str], forward: ForwardFn, view: BufferView
    ) -> None:
        gm, examples, args, outputs, spec = _trace(forward, view)
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ints: dict[int, Any] = {}
        for i, (a, ex) in enumerate(zip(args, examples, strict=True)):
            if isinstance(a, torch.Tensor):
                continue
            sym = _sym(ex)
            rule = next(
                (
                    (j, d)
                    for j in tensors
                    for d, n in enumerate(examples[j].shape)
                    if sym is not None and _sym(n) == sym
                ),
                None,
            )
            node = list(gm.graph.find_nodes(op="placeholder"))[i]
            if rule is None and node.users:
                raise AotRefused(f"the graph reads a size ({ex}) no buffer's shape gives")
            ints[i] = rule
        paths = _find_paths({"forward": forward, "view": view}, [args[i] for i in tensors])
        dims: dict[str, Any] = {}
        dynamic: list[dict[int, Any] | None] = []
        manifest_args = []
        for j, path in zip(tensors, paths, strict=True):
            t, ex = args[j], examples[j]
            shape = [_sym(n) or int(n) for n in ex.shape]
            spec_j = {}
            for d, n in enumerate(shape):
                if isinstance(n, str) and t.shape[d] == 1:
                    # Only size 1 is captured: export has no range 1..1 to give,
                    # so the program is exported at that one size.
                    shape[d] = 1
                elif isinstance(n, str):
                    if not n.isidentifier():
                        raise AotRefused(f"a buffer's rows are {n}; only a plain batch is saved")
                    spec_j[d] = dims.setdefault(n, torch.export.Dim(n, min=1, max=t.shape[d]))
            dynamic.append(spec_j or None)
            stride = [None if _sym(s) else int(s) for s in ex.stride()]
            manifest_args.append(
                {
                    "path": [list(step) for step in path],
                    "dtype": str(t.dtype),
                    "device": t.device.type,
                    "shape": shape,
                    "stride": stride,
                }
            )
        self._manifest = {
            "key": key,
            "args": manifest_args,
            "spec": pytree.treespec_dumps(spec),
            "outputs": outputs,
        }
        flat = _Flat(gm, ints, len(args))
        real = tuple(args[i] for i in tensors)
        package = self._compile(flat, real, tuple(dynamic))
        self._manifest["eager deviation"] = self._measure(package, forward, view)
        try:
            _write(folder, self._manifest, package)
            # Another process saving the same key (servers started at once)
            # may move this folder aside for its own at any moment: what is
            # read back here may be gone, and the step then compiles as
            # without the cache rather than failing the capture.
            self._manifest = json.loads((folder / MANIFEST).read_text())
            self._open(folder / PACKAGE)
        except (OSError, RuntimeError) as e:
            raise AotRefused(f"cannot save in {folder.parent} ({e})") from None

    def _beside_eager(
        self, package: Path, forward: ForwardFn, view: BufferView
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``package`` opened and run once on ``view``'s arguments (as the
        manifest names them), and the eager forward's outputs, both flat."""
        self._open(package)
        try:
            args = self._arguments(forward, view)
        except (KeyError, AttributeError, IndexError, TypeError) as e:
            raise AotRefused(f"an argument's path does not resolve here ({e!r})") from None
        expected = pytree.tree_flatten(forward(view))[0]
        try:
            got = self._pick(self._loader.run(args), self._manifest["outputs"])
        except (RuntimeError, IndexError) as e:
            raise AotRefused(f"the loaded program fails ({str(e).splitlines()[0]})") from None
        return got, expected

    def _measure(self, package: Path, forward: ForwardFn, view: BufferView) -> float:
        """How far the built ``package`` is from the eager forward at this
        size (:func:`_deviation`): what a later load may differ by, twice."""
        got, expected = self._beside_eager(package, forward, view)
        exact = [(a, b) for a, b in zip(got, expected, strict=True) if not a.is_floating_point()]
        if not all(_close(a, b) for a, b in exact):  # tokens drawn otherwise than eager
            raise AotRefused("the built program's integer outputs differ from the eager forward's")
        return _deviation(got, expected)

    def _compile(self, flat: _Flat, args: tuple[torch.Tensor, ...], dynamic: Any) -> Path:
        from torch._inductor import aoti_compile_and_package

        stage = Path(tempfile.mkdtemp(prefix="graphrunner-aot-"))
        try:
            with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
                # torch 2.13's export calls its own deprecated pytree check: a
                # FutureWarning a user of graphrunner can do nothing about.
                warnings.filterwarnings("ignore", _TORCH_OWN_DEPRECATION, FutureWarning)
                ep = torch.export.export(flat, args, dynamic_shapes=(dynamic,), strict=False)
                out = aoti_compile_and_package(
                    ep, package_path=str(stage / PACKAGE), inductor_configs=self.patches
                )
        except Exception as e:  # export or AOTInductor cannot take this graph
            shutil.rmtree(stage, ignore_errors=True)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise AotRefused(f"AOTInductor cannot compile the step: {first}") from None
        return Path(out)


def _trace(
    forward: ForwardFn, view: BufferView
) -> tuple[torch.fx.GraphModule, list[Any], list[Any], list[int], Any]:
    """Dynamo's graph of ``forward(view)``, batch symbolic, run once uncompiled:
    the graph, its example inputs, the arguments dynamo passed, where each
    output leaf sits among the graph's outputs, the outputs' tree spec."""
    from graphrunner.mechanisms.compile import mark_batch_dynamic, named_step, size_oblivious
    from graphrunner.mechanisms.shape_guards import TraceGuards, without_shape_guards
    from graphrunner.sampling.gate import branch_free

    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if "gm" in seen:
            raise AotRefused("the forward compiles to more than one graph")
        seen["gm"], seen["guards"] = gm, TraceGuards.of_trace(gm)
        seen["examples"] = [
            n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")
        ]

        def program(*args: Any) -> Any:
            out = gm(*args)
            seen.setdefault("args", list(args))
            seen.setdefault("raw", list(out) if isinstance(out, list | tuple) else [out])
            return out

        return program

    step = torch.compile(
        named_step("graphrunner_aot_step"),
        backend=backend,
        fullgraph=True,
        options={"guard_filter_fn": without_shape_guards},
    )
    mark_batch_dynamic(view)
    try:
        with size_oblivious(), branch_free() as gated:
            result = step(forward, view)
    except torch._dynamo.exc.Unsupported as e:
        raise AotRefused(f"graph break: {str(e).strip().splitlines()[0]}") from None
    if "args" not in seen:
        raise AotRefused("the forward compiled to no graph")
    if gated.gates:
        # Compiled in process, the step skips the sampler's sort, the
        # penalties, the min_tokens hold and the grammar mask where no live
        # row needs them (torch.cond); a saved one would run them every step:
        # SmolLM2 int4-q8 served at 8 streams, 71.2 ms a token against 26.3.
        raise AotRefused(
            f"the step skips work no live row needs at {gated.gates} gate(s) (torch.cond), "
            "which a saved program cannot (torch 2.13's export): it would do that work "
            "every step"
        )
    # Traced at the runner's largest size, the program serves every size up
    # to it (the export's range): decisions on the batch that come out the
    # same at each of those sizes are no reason to refuse it.
    trace_guards = seen["guards"]
    if not trace_guards.hold_up_to(seen["args"]):
        guards = trace_guards.guards
        shown = ", ".join(str(g) for g in guards[:3]) + (", ..." if len(guards) > 3 else "")
        raise AotRefused(f"the forward decides on the batch size (shape guards: {shown})")
    leaves, spec = pytree.tree_flatten(result)
    raw = seen["raw"]
    order = []
    for leaf in leaves:
        index = next((k for k, r in enumerate(raw) if r is leaf), None)
        if index is None:
            raise AotRefused("an output is not one of the graph's own")
        order.append(index)
    return seen["gm"], seen["examples"], seen["args"], order, spec


def _write(folder: Path, manifest: dict[str, Any], package: Path) -> None:
    """Package and manifest into ``folder`` at once: staged beside it, renamed in."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        shutil.move(str(package), stage / PACKAGE)
        shutil.rmtree(package.parent, ignore_errors=True)
        manifest = {
            **manifest,
            "package bytes": (stage / PACKAGE).stat().st_size,
            "package sha256": _file_sha(stage / PACKAGE),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        with open(stage / MANIFEST, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        with open(stage / PACKAGE, "rb") as f:
            os.fsync(f.fileno())
        if folder.exists():  # a refused one: out of the way first
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}-old-", dir=folder.parent))
            os.replace(folder, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(stage, folder)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
