"""The compile step shared by the CPU runner and the CUDA runner's
``compile=True``, with a backend that records each inductor program it makes.

By default (``dynamic=True``) the step is compiled **once**, with the batch
dimension of every static buffer symbolic, and that one program serves every
captured size: capture costs one compilation, not one per size. Sizes are
traced size-oblivious and dynamo's shape guards are checked by the compiler
itself (:mod:`graphrunner.mechanisms.shape_guards`), so batch 1 shares the
program, while a size the forward decides on differently (a Python branch on
the batch) gets a program of its own. ``dynamic=False`` compiles one program
per size, each on its own code object (so dynamo's per-code recompile limit
never sends a size to eager): the baseline the benchmark compares against.

Each size's program is then called directly with the arguments dynamo passed
it at capture, skipping dynamo's frame evaluation and guards: sound for the
reason a graph replay is, since the inputs are the static buffers and the
model's own tensors at fixed addresses and shapes, and the forward must be a
pure tensor program (as graphs require too). A ``ChunkSafeCall`` makes the
call (:mod:`graphrunner.util.stack_chunks`).

Where inductor keeps its caches (``TORCHINDUCTOR_CACHE_DIR``, by default
``/tmp/torchinductor_$USER``) a second run of the same model and sizes
compiles nothing: :attr:`SizeCompiler.cache_hits` counts the compilations a
cache answered.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphrunner.declare.buffers import BufferView
from graphrunner.declare.outputs import Outputs
from graphrunner.mechanisms.base import ForwardFn, Launcher
from graphrunner.mechanisms.shape_guards import TraceGuards, without_shape_guards
from graphrunner.mechanisms.uncapturable import uncapturable
from graphrunner.util.warn import warn_at_caller

__all__ = ["CUDAGRAPH_OPTION", "SizeCompiler", "inductor_patches"]

#: The inductor option that makes inductor capture CUDA graphs of its own.
CUDAGRAPH_OPTION = "triton.cudagraphs"

#: A program dynamo called: the inductor callable, its arguments, its trace's guards.
_Call = tuple[Callable[..., Sequence[torch.Tensor]], list[Any], TraceGuards]


def inductor_patches(mode: str | None, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Inductor config patches for ``mode`` plus ``options``, with inductor's
    own CUDA graphs refused: graphrunner captures the graph itself, and a
    graph captured over inductor's graphs is unsound (an illegal memory access
    on replay)."""
    from torch._inductor import list_mode_options

    if mode is not None and not isinstance(mode, str):
        raise TypeError(f"compile_mode={mode!r}; expected a str or None")
    try:
        patches = dict(list_mode_options(mode)) if mode else {}
    except RuntimeError as e:  # inductor names the known modes
        raise ValueError(f"compile_mode={mode!r}: {e}") from None
    if patches.get(CUDAGRAPH_OPTION):
        raise ValueError(
            f"compile_mode={mode!r} turns on inductor's own CUDA graphs, which must never be "
            f"captured inside graphrunner's; use 'default' or 'max-autotune-no-cudagraphs'"
        )
    user = dict(options or {})
    if user.get(CUDAGRAPH_OPTION):
        raise ValueError(
            f"inductor_options[{CUDAGRAPH_OPTION!r}]=True turns on inductor's own CUDA "
            f"graphs, which must never be captured inside graphrunner's"
        )
    return {**patches, **user, CUDAGRAPH_OPTION: False}


def _step(forward: Any, view: BufferView) -> Outputs:
    return forward(view)


def named_step(name: str) -> types.FunctionType:
    """``forward(view)`` on a code object of its own (dynamo caches per code)."""
    code = _step.__code__.replace(co_name=name)
    return types.FunctionType(code, _step.__globals__, code.co_name)


def mark_batch_dynamic(view: BufferView) -> None:
    """Every static buffer's first dimension (its rows) is the batch: symbolic."""
    for tensor in view.tensors().values():
        if tensor.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Batch 1 traced like any other size, not specialised (dynamo otherwise
    specialises sizes 0 and 1, and batch 1 would compile a program of its own)."""
    from torch.fx.experimental import _config as shape_config

    with shape_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        yield


def _cache_hits() -> int:
    """Compilations answered by inductor's FX graph cache or AOTAutograd's cache."""
    from torch._dynamo.utils import counters

    return (
        counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    )


def _identical(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same shape, dtype and values, NaN where the other has NaN: padded rows
    may compute NaN (e.g. the log of a padded position) on both paths."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if torch.equal(x, y):
        return True
    return x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))


class SizeCompiler:
    """Compiles a forward with inductor (once, or once per size) and calls each
    size's program directly.

    Args:
        patches: inductor config patches (see :func:`inductor_patches`).
        dynamic: one program with a symbolic batch dimension for every size
            (True), or one shape-specialised program per size (False).
        fullgraph: a graph break raises :class:`UncapturableError` naming it
            (False: that size runs through dynamo, counted and warned).
    """

    def __init__(
        self, patches: Mapping[str, Any], *, dynamic: bool = True, fullgraph: bool = False
    ) -> None:
        for name, value in (("dynamic", dynamic), ("fullgraph", fullgraph)):
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r}; expected a bool")
        self.patches = dict(patches)
        self.dynamic = dynamic
        #: Refuse a forward with a graph break (UncapturableError) instead of
        #: running it through dynamo piecewise.
        self.fullgraph = fullgraph
        self._shared = named_step("graphrunner_step")  # dynamic: every size's code
        self._compiled: Callable[..., Any] | None = None
        self._compiling_bs = 0
        self._per_size: dict[int, int] = {}
        self._steps: dict[int, tuple[ForwardFn, BufferView]] = {}
        self._recording: list[_Call] | None = None
        #: Inductor compilations so far (replays never add one: they skip dynamo).
        self.compilations = 0
        #: Of those, the ones inductor's or AOTAutograd's cache answered (a warm start).
        self.cache_hits = 0
        #: Sizes launched through dynamo because their program cannot be called directly.
        self.direct_fallbacks = 0
        # Programs whose direct call reproduced dynamo's outputs once (one
        # program serves every size: it is checked at its first).
        self._verified: dict[int, Callable[..., Any]] = {}  # held: their ids stay theirs
        #: The outputs of the last size's recorded run (the capture's own).
        self.recorded: Outputs | None = None

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        hits = _cache_hits()
        guards = TraceGuards.of_trace(gm)  # before lowering adds its own
        compiled = compile_fx(gm, example_inputs, config_patches=self.patches)
        if not callable(compiled):  # compile_fx's union also covers AOT artefacts
            raise TypeError(f"inductor returned {type(compiled).__name__}, not a callable")
        self.compilations += 1
        self.cache_hits += _cache_hits() > hits
        self._per_size[self._compiling_bs] = self._per_size.get(self._compiling_bs, 0) + 1

        def program(*args: Any) -> Any:
            if self._recording is not None:  # capture asks which program ran, on what
                self._recording.append((compiled, list(args), guards))
            return compiled(*args)

        return program

    def step_fn(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        """The dynamo-compiled step of size ``bs``; compiles on its first call
        (with ``dynamic``, only the first size compiles)."""
        self._compiling_bs = bs
        self._steps[bs] = (forward, view)
        if not self.dynamic:
            return self._specialised(bs, forward, view)
        if self._compiled is None:
            self._compiled = torch.compile(
                self._shared,
                backend=self._backend,
                fullgraph=self.fullgraph,
                options={"guard_filter_fn": without_shape_guards},
            )
        compiled = self._compiled
        mark_batch_dynamic(view)

        def launch() -> Outputs:
            with size_oblivious(), self._refusing(bs):
                return compiled(forward, view)

        return launch

    def _specialised(self, bs: int, forward: ForwardFn, view: BufferView) -> Launcher:
        """Size ``bs``'s own shape-specialised step, on a code object of its own."""
        step = torch.compile(
            named_step(f"graphrunner_step_bs{bs}"),
            backend=self._backend,
            dynamic=False,
            fullgraph=self.fullgraph,
        )

        def launch() -> Outputs:
            with self._refusing(bs):
                return step(forward, view)

        return launch

    @contextlib.contextmanager
    def _refusing(self, bs: int) -> Iterator[None]:
        """With ``fullgraph``, dynamo's graph break as an :class:`UncapturableError`."""
        try:
            yield
        except torch._dynamo.exc.Unsupported as e:
            if not self.fullgraph:
                raise
            raise uncapturable(bs, e) from None

    def programs(self, bs: int) -> int:
        """Programs compiled while size ``bs`` warmed up (0: it reused one)."""
        return self._per_size.get(bs, 0)

    def launcher(self, bs: int, fn: Launcher) -> Launcher:
        """Size ``bs``'s program called directly; where that cannot be, ``fn``
        (the dynamo path), counted in :attr:`direct_fallbacks` and warned once.
        A size the one program's trace guards exclude (the forward decides on
        the batch size) is compiled on its own first."""
        calls, expected, spec = self._record(fn)
        if len(calls) == 1 and not calls[0][2].hold(calls[0][1]):
            self._compiling_bs = bs
            fn = self._specialised(bs, *self._steps[bs])
            calls, expected, spec = self._record(fn)
        self.recorded = pytree.tree_unflatten(expected, spec)
        direct = self._direct(calls, expected, spec, self._verified)
        if direct is not None:
            from graphrunner.util.stack_chunks import ChunkSafeCall  # with the first launcher

            return ChunkSafeCall(direct)
        self.direct_fallbacks += 1
        if self.direct_fallbacks == 1:
            warn_at_caller(
                f"size {bs}: the compiled program cannot be called directly (graph break, "
                f"or outputs not reproduced); running it through dynamo, with its guard "
                f"cost (counted in runner.direct_fallbacks, warned once)"
            )
        return fn

    def _record(self, fn: Launcher) -> tuple[list[_Call], list[Any], Any]:
        """Run ``fn`` once: the programs it called (with their arguments) and
        its outputs, flattened, with their tree spec."""
        self._recording = []
        try:
            expected, spec = pytree.tree_flatten(fn())
        finally:
            calls, self._recording = self._recording, None
        return calls, expected, spec

    @staticmethod
    def _direct(
        calls: list[_Call], expected: list[Any], spec: Any, verified: dict[int, Any]
    ) -> Launcher | None:
        """A launcher calling the one program of ``calls`` directly with its
        arguments; None where there is not exactly one (a graph break, or
        nothing compiled) or the direct call's outputs differ from
        ``expected`` (the dynamo path's), which is checked once per program
        (``verified`` holds those checked)."""
        if len(calls) != 1:
            return None
        program, inputs, _ = calls[0]
        if id(program) not in verified:
            if not _same(expected, list(program(*inputs))):
                return None
            verified[id(program)] = program
        if spec == pytree.tree_flatten(torch.empty(0))[1]:  # a single tensor: skip pytree
            return lambda: program(*inputs)[0]
        return lambda: pytree.tree_unflatten(list(program(*inputs)), spec)

    def drop(self) -> None:
        self._per_size.clear()
        self._steps.clear()
        self._verified.clear()
        self.recorded = None
        self.direct_fallbacks = 0  # a retried capture counts (and warns) afresh
