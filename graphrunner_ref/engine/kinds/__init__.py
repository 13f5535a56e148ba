"""The built-in model kinds, registered in the order the registry asks them
last to first: a Mamba / hybrid checkpoint first, then the native Llama
(the embedded models, and every checkpoint it runs), then the transformers
bridge, which takes any other checkpoint."""

from __future__ import annotations

from graphrunner_ref.engine.kinds import llama, state_space, transformers
from graphrunner_ref.engine.registry import register

__all__ = ["BUILT_IN"]

#: The built-in kinds, registered once when this package is imported.
BUILT_IN = (transformers.KIND, llama.KIND, state_space.KIND)

for _kind in BUILT_IN:
    register(_kind)
