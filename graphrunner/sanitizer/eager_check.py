"""Check a replay against the eager forward, without hiding stray writes.

Calling the eager model and then replaying on the same state hides a stray
write: the eager call wrote the value first, and a write that leaves a value
unchanged cannot be seen. :func:`check_against_eager` runs the eager forward
from the state as it was, keeps what it wrote, puts the state back, replays
from the same state, and compares: every output within tolerance, and every
row of every state tensor but the sink row 0 equal to the eager run's (the
live rows' writes equal, every other row untouched), reported per output and
per row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphrunner.declare.outputs import Outputs, named_outputs
from graphrunner.sanitizer.checks import GuardedTensor, PaddingViolation

__all__ = ["EagerComparison", "check_against_eager"]


class _Replays(Protocol):
    forward: Callable[..., Outputs]

    def replay(self, inputs: Any) -> Outputs: ...


@dataclass
class EagerComparison:
    """What :func:`check_against_eager` found.

    outputs: each output's largest absolute difference, replay against eager.
    mismatched_outputs: ``(output, batch row)`` of each output beyond tolerance.
    state_rows: ``(state, row)`` of each state row whose replay value differs
        from the eager run's (a stray write, or a live write that differs).
    replayed: the replay's outputs by name (the live rows), to go on with.
    """

    outputs: dict[str, float] = field(default_factory=dict)
    replayed: dict[str, torch.Tensor] = field(default_factory=dict)
    mismatched_outputs: list[tuple[str, int]] = field(default_factory=list)
    state_rows: list[tuple[str, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatched_outputs and not self.state_rows

    def format(self) -> str:
        if self.ok:
            worst = max(self.outputs.values(), default=0.0)
            return f"replay equals eager: max |diff| {worst:.2e}, state rows equal"
        lines = [
            f"output {n!r} batch row {r}: differs from eager" for n, r in self.mismatched_outputs
        ]
        lines += [f"{n} row {r}: differs from the eager run's" for n, r in self.state_rows]
        return "\n".join(lines)

    def raise_if_any(self) -> None:
        """:class:`PaddingViolation` listing every difference, if any."""
        if not self.ok:
            raise PaddingViolation(self.format())


def _state_entry(i: int, s: GuardedTensor | torch.Tensor) -> tuple[str, torch.Tensor]:
    return (s.name, s.tensor) if isinstance(s, GuardedTensor) else (f"state[{i}]", s)


def _rows(bad: torch.Tensor) -> list[int]:
    return [int(r) for r in bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten()]


def check_against_eager(
    runner: _Replays,
    inputs: Any,
    state: Sequence[GuardedTensor | torch.Tensor],
    *,
    forward: Callable[[Any], Outputs] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> EagerComparison:
    """Replay ``inputs`` and run the eager forward from the same state; compare.

    Args:
        runner: a captured runner (its :meth:`replay`).
        inputs: the step's inputs (a batch with the declared fields).
        state: every tensor the step may write, indexed by row along dim 0
            (``GuardedTensor`` s, e.g. ``sanitizer.guarded``, or bare tensors).
        forward: the eager step (default ``runner.forward``, called on ``inputs``).

    Returns the comparison; the state is left as the replay left it. Call
    :meth:`EagerComparison.raise_if_any` to fail loudly.
    """
    named = [_state_entry(i, s) for i, s in enumerate(state)]
    step = runner.forward if forward is None else forward
    before = [t.clone() for _, t in named]
    with torch.no_grad():
        expected = {k: v.clone() for k, v in named_outputs(step(inputs))}
    eager_state = [t.clone() for _, t in named]
    for (_, t), old in zip(named, before, strict=True):
        t.copy_(old)  # the replay starts from the state the eager run started from
    got = dict(named_outputs(runner.replay(inputs)))
    result = EagerComparison(replayed=got)
    for name, want in expected.items():
        have = got[name]
        if want.is_floating_point():
            close = torch.isclose(have.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True)
            result.outputs[name] = float((have.float() - want.float()).abs().nan_to_num().max())
        else:
            close = have == want
            result.outputs[name] = float((~close).sum())
        result.mismatched_outputs += [(name, r) for r in _rows(~close)]
    for (name, t), want in zip(named, eager_state, strict=True):
        same = (
            torch.isclose(t, want, rtol=0, atol=0, equal_nan=True)
            if t.is_floating_point()
            else t == want
        )
        # Row 0 is the padded rows' sink, written by the replay only.
        result.state_rows += [(name, r) for r in _rows(~same) if r > 0]
    return result
