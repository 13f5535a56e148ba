"""JSON text read from a user's file, its two crashes turned into one error.

``json.loads`` raises ``RecursionError`` on deep nesting (``[[[[...``) and a
plain ``ValueError`` on an int past Python's digit limit (4300 digits);
:func:`loads` raises :class:`JSONLimitError` for both, and lets
``json.JSONDecodeError`` (text that is not JSON) through as it is.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSONLimitError", "loads"]


class JSONLimitError(ValueError):
    """Valid JSON nested too deeply, or with an int of too many digits."""


def loads(text: str) -> Any:
    """``json.loads(text)``; :class:`JSONLimitError` saying which limit was
    passed, ``json.JSONDecodeError`` for text that is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise JSONLimitError("nested too deeply") from None
    except ValueError as e:  # "Exceeds the limit (4300 digits) ...; use sys.set_..."
        raise JSONLimitError(str(e).split(";")[0]) from None
