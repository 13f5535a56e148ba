"""The one way to build a runner, :func:`create_runner`, and the two runners
known by their mechanism, each exactly ``create_runner`` with its kind fixed."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from graphrunner.core.options import RunnerOptions
from graphrunner.core.phase import Phase
from graphrunner.core.runner import GraphRunner
from graphrunner.declare.buffers import BufferSpec
from graphrunner.declare.hooks import BaseGraphBackend
from graphrunner.declare.outputs import OutputsDecl
from graphrunner.mechanisms.base import ForwardFn
from graphrunner.util.warn import warn_at_caller

__all__ = ["CpuGraphRunner", "CudaGraphRunner", "create_runner", "runner_parts"]

#: What a forward given with its specs may say of its phase (a Phase carries its own).
_PHASE_FIELDS = ("outputs", "backend", "width")


def create_runner(
    step: ForwardFn | Phase,
    specs: Sequence[BufferSpec] | None = None,
    *legacy: Any,
    options: RunnerOptions | None = None,
    **fields: Any,
) -> GraphRunner:
    """A runner for ``step``: not yet captured (call ``capture()``).

    Args:
        step: a :class:`~graphrunner.Phase` (forward, buffers, outputs,
            backend, width), or a forward ``view -> outputs`` whose buffers
            ``specs`` declares.
        specs: the static buffers and their pad rules, with a forward only.
        options: a :class:`~graphrunner.core.RunnerOptions` (kind, device,
            sizes, sanitizer, mechanism options...).
        **fields: options given one by one (they replace those of
            ``options``); with a forward also ``outputs``, ``backend`` and
            ``width`` (the phase's).

    ``create_runner(kind, step, specs, ...)``, the first release's form, still
    works and warns (``kind=`` is the keyword now).

    Raises:
        ValueError: an unknown ``kind``; a phase with ``specs``, ``outputs``,
            ``backend`` or ``width`` given too, or a forward without ``specs``.
        TypeError: an unknown option, or a mechanism option the kind does not
            take (named).
    """
    if isinstance(step, str):
        warn_at_caller(
            f"create_runner({step!r}, step, ...) is deprecated; use "
            f"create_runner(step, ..., kind={step!r})",
            DeprecationWarning,
        )
        return create_runner(specs, *legacy, options=options, kind=step, **fields)
    if legacy:
        raise TypeError(f"create_runner takes step and specs positionally, got {2 + len(legacy)}")
    return GraphRunner(*runner_parts(step, specs, options, fields))


def _shown_signature() -> inspect.Signature:
    """What ``help(create_runner)`` and IDEs show: every option by name, from
    the one dataclass that spells them (the code takes them as ``**fields``)."""
    param = inspect.Parameter
    named = [
        param("step", param.POSITIONAL_OR_KEYWORD),
        param("specs", param.POSITIONAL_OR_KEYWORD, default=None),
        param("options", param.KEYWORD_ONLY, default=None),
    ]
    named += [
        param(f.name, param.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(RunnerOptions)
    ]
    named += [param(name, param.KEYWORD_ONLY, default=None) for name in _PHASE_FIELDS]
    return inspect.Signature(named, return_annotation="GraphRunner")


create_runner.__signature__ = _shown_signature()  # type: ignore[attr-defined]


def runner_parts(
    step: ForwardFn | Phase,
    specs: Sequence[BufferSpec] | None,
    options: RunnerOptions | None,
    fields: Mapping[str, Any],
    **fixed: Any,
) -> tuple[Phase, RunnerOptions]:
    """The phase and the options :func:`create_runner` builds a runner of;
    ``fixed`` are what a named runner fixes (its kind), refused if given."""
    for name in sorted(set(fixed) & set(fields)):
        raise TypeError(f"{name}={fields[name]!r}: this runner fixes {name}={fixed[name]!r}")
    phase_fields = {k: fields[k] for k in _PHASE_FIELDS if k in fields}
    others = {k: v for k, v in fields.items() if k not in phase_fields}
    phase = _as_phase(step, specs, **phase_fields)
    return phase, RunnerOptions.of(options, {**others, **fixed})


def _as_phase(
    step: ForwardFn | Phase,
    specs: Sequence[BufferSpec] | None,
    *,
    outputs: OutputsDecl | None = None,
    backend: BaseGraphBackend | None = None,
    width: int | None = None,
) -> Phase:
    if isinstance(step, Phase):
        given = {"specs": specs, "outputs": outputs, "backend": backend, "width": width}
        for name, value in given.items():
            if value is not None:
                raise ValueError(
                    f"{name}: a Phase carries its own ({step.name!r}); expected None with a phase"
                )
        return step
    if specs is None:
        raise ValueError("specs: a forward needs its buffers declared; expected a BufferSpec list")
    if not callable(step):
        raise TypeError(f"step must be a Phase or a callable forward, got {type(step).__name__}")
    return Phase("custom", step, tuple(specs), outputs=outputs, backend=backend, width=width)


class _KindBound(GraphRunner):
    """``create_runner`` with the kind fixed by the subclass's ``fixed_kind``."""

    fixed_kind: ClassVar[str]

    def __init__(
        self,
        step: ForwardFn | Phase,
        specs: Sequence[BufferSpec] | None = None,
        *,
        options: RunnerOptions | None = None,
        **fields: Any,
    ) -> None:
        super().__init__(*runner_parts(step, specs, options, fields, kind=self.fixed_kind))


class CudaGraphRunner(_KindBound):
    """``create_runner(step, specs, kind="cuda", ...)``: one CUDA graph per
    size, captured largest first on a side stream into one shared memory
    pool; replay returns views of the graph's static outputs (the graphs:
    ``runner.mechanism.graphs``)."""

    fixed_kind = "cuda"


class CpuGraphRunner(_KindBound):
    """``create_runner(step, specs, kind="cpu", ...)``: the forward compiled
    once by inductor, the batch dimension symbolic, and that program called
    directly at each captured size, padded."""

    fixed_kind = "cpu"
