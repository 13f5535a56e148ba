"""``graphrunner serve``: an OpenAI-compatible HTTP server over the one engine path.

One thread owns the model, its pools and the engine and steps it
(:mod:`~graphrunner_ref.serve.online`: requests into
:meth:`~graphrunner_ref.engine.loop.Engine.add_request`, outputs out of
:meth:`~graphrunner_ref.engine.loop.Engine.step`); the HTTP side
(:mod:`~graphrunner_ref.serve.app`) only validates
(:mod:`~graphrunner_ref.serve.protocol`, :mod:`~graphrunner_ref.serve.errors`),
queues and streams. :mod:`~graphrunner_ref.serve.metrics` is ``/metrics``;
:mod:`~graphrunner_ref.serve.server` starts and stops it all.

Nothing here is imported by ``import graphrunner`` or ``import
graphrunner_ref``: FastAPI, uvicorn, pydantic and prometheus-client (the
``[serve]`` extra) load when ``graphrunner serve`` runs.
"""

from __future__ import annotations

__all__: list[str] = []
