"""The error of a forward that cannot be captured as one program, named by
dynamo's reason and the line of the model's code that made it."""

from __future__ import annotations

__all__ = ["UncapturableError", "uncapturable"]


class UncapturableError(RuntimeError):
    """The forward cannot be captured as one program: a host sync or a branch
    on a tensor's value (dynamo's graph break), named by its reason and the
    line of the model's code that made it."""


def uncapturable(bs: int, error: Exception) -> UncapturableError:
    """``error`` (dynamo's) as one line: the size, the reason, where."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    stack = list(getattr(error, "real_stack", None) or [])  # the innermost frame is where
    where = f" in {stack[-1].name} ({stack[-1].filename}:{stack[-1].lineno})" if stack else ""
    return UncapturableError(
        f"size {bs}: the forward cannot be captured{where}: {reason}; a captured step "
        "must be a pure tensor program (no .item(), .tolist() or branch on a tensor's "
        "value): move that decision out of the step, or use the eager runner"
    )
