"""Models with Mamba layers in the engine: earlier names, kept as bindings.

A :class:`~graphrunner_ref.io.mamba_checkpoint.StateSpaceBundle` is served by the
one :class:`~graphrunner_ref.engine.loop.Engine`; what its decode step adds (each
row's Mamba slot, the recorded state ops run before launch, the sanitizer of
the Mamba state) is its :class:`~graphrunner_ref.engine.bundle.DecodeStep`. The
bundle's request pool is a :class:`~graphrunner.pools.HybridReqToTokenPool`,
so admitting a request allocates its Mamba slot (and records its clear) and
retiring it frees the slot; a prefill runs the recorded ops first itself.
"""

from __future__ import annotations

from graphrunner_ref.engine.bundle import create_decode_runner
from graphrunner_ref.engine.loop import Engine
from graphrunner_ref.engine.mamba_step import MambaSanitizer, StateSpaceInputs

__all__ = ["MambaSanitizer", "StateSpaceEngine", "StateSpaceInputs", "create_state_space_runner"]

#: The engine over a state-space bundle is the one engine (``check=True`` is
#: refused for it: a recurrent state advanced twice is not the state of one step).
StateSpaceEngine = Engine


#: :func:`~graphrunner_ref.engine.bundle.create_decode_runner` under its earlier name
#: for a :class:`StateSpaceBundle`: the decode fields with the Mamba ones, the
#: request pool's recorded state ops run before launch, and with
#: ``check_padding=True`` a :class:`MambaSanitizer` over ``req_to_token``, the
#: KV layers (hybrid) and the Mamba state.
create_state_space_runner = create_decode_runner
