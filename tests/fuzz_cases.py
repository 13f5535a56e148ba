"""The phases the padding fuzz replays: each a runner over a world, how to
make its inputs for ``n`` live requests, its eager forward, and which state
rows its live rows may write (the rest must stay bit-identical).

Decode, the sampled decode (the decode step picking its tokens in the
graph, its sampling buffers' tails poisoned too), target verify (plain, and
sampling: rejection inside the graph, its ``q`` and sampling tails poisoned), EAGLE draft
extend and draft decode and frozen-KV MTP run over
:class:`spec_world.SpecWorld` (a small Llama target with prefilled requests
and bystanders); the state-space decode over a small random Mamba-1 model
whose live and bystander slots hold random state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sampled_rows import sampled_decode_phase, sampled_verify_inputs, sampling_rows

from graphrunner import GraphRunner, create_runner
from graphrunner.batch.decode_batch import DecodeBatch
from graphrunner.declare.hooks import NullBackend
from graphrunner.phases import (
    Phase,
    SpecBatch,
    decode_phase,
    eagle_draft_decode_phase,
    eagle_draft_extend_phase,
    frozen_kv_mtp_phase,
    frozen_kv_sanitizer,
    token_batch_phase,
    verify_phase,
)
from graphrunner.phases.sampled import with_sampling
from graphrunner.sanitizer.padding import PaddingSanitizer
from graphrunner_ref.engine.mamba_step import MambaSanitizer, state_space_inputs
from graphrunner_ref.io.mamba_checkpoint import build_state_space_model
from graphrunner_ref.model.mamba import MambaConfig
from graphrunner_ref.model.mamba_mixer import MixerShape
from spec_world import CONTEXT, SpecWorld

#: Tokens per request of the multi-token phases (verify, draft extend).
W = 3
#: The phases, in report order.
PHASES = (
    "decode",
    "sampled_decode",
    "verify",
    "sampled_verify",
    "eagle_extend",
    "eagle_decode",
    "mtp",
    "mamba_decode",
    "token_batch",
)
#: The most requests a token-batch step of the fuzz holds.
TOKEN_REQUESTS = 3
#: Every mechanism by label: the runner kind and its options (CUDA ones need a GPU).
MECHANISMS: dict[str, tuple[str, dict[str, Any]]] = {
    "eager": ("eager", {}),
    "cpu": ("cpu", {}),
    "cuda": ("cuda", {}),
    "cuda+fused": ("cuda", {"populate": "fused"}),
    "cuda+graph": ("cuda", {"populate": "graph"}),
    "cuda+compile": ("cuda", {"compile": True}),
}


def device_of(label: str) -> str:
    return "cuda" if label.startswith("cuda") else "cpu"


class FuzzCase:
    """One phase on one mechanism, captured at ``sizes``.

    ``writable(inputs)``: state name -> the rows the live rows may write;
    ``sinks``: state name -> the rows padded rows may write (slot 0 of the KV
    the phase writes; none of a Mamba pool, whose padded rows discard their
    update). Every other row of every state tensor must stay bit-identical.
    ``padding_reads``: state name -> the rows padded rows read (slot 0), which
    the fuzz fills with hostile floats.
    """

    phase: str
    runner: GraphRunner
    forward: Callable[[Any], Any]
    vocab: int
    sinks: dict[str, list[int]]
    padding_reads: dict[str, list[int]]

    def build(self, phase: Phase, label: str, sizes: list[int], sanitizer: Any, **kw: Any) -> None:
        kind, options = MECHANISMS[label]
        self.runner = create_runner(
            phase,
            kind=kind,
            **options,
            device=device_of(label),
            capture_sizes=sizes,
            sanitizer=sanitizer,
            show_progress=False,
            **kw,
        )
        self.runner.capture()

    def inputs(self, raw_bs: int, seed: int) -> Any:
        """Fresh pools with bystanders and ``raw_bs`` live requests; their inputs."""
        raise NotImplementedError

    def state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def writable(self, inputs: Any) -> dict[str, list[int]]:
        raise NotImplementedError

    def bystander(self) -> dict[str, int]:
        """Index values of a request outside the batch (its row, a cached slot, ...)."""
        raise NotImplementedError

    def limits(self) -> dict[str, int]:
        """The first out-of-range value of each index kind (``Index.value`` keys)."""
        raise NotImplementedError


class SpecCase(FuzzCase):
    """A phase of the Llama target or its draft heads over a :class:`SpecWorld`."""

    def __init__(self, phase: str, label: str, sizes: list[int], *, sanitize: bool = True) -> None:
        self.phase = phase
        self.world = w = SpecWorld(device_of(label))
        b, model = w.bundle, w.model
        self.vocab = vocab = model.config.vocab_size
        kv = w.draft_kv if phase.startswith("eagle") else b.kv_cache
        sanitizer: PaddingSanitizer | None = None
        if sanitize and phase == "mtp":
            sanitizer = frozen_kv_sanitizer(b.req_pool, b.kv_cache, vocab_size=vocab)
        elif sanitize:
            sanitizer = PaddingSanitizer.for_pools(
                b.req_pool, kv, kv_allocator=b.kv_alloc, vocab_size=vocab
            )
        made = {
            "decode": lambda: decode_phase(model.forward_decode, backend=model.attn_backend),
            "sampled_decode": lambda: sampled_decode_phase(
                model.forward_decode, model.attn_backend
            ),
            "verify": lambda: verify_phase(model, W),
            "sampled_verify": lambda: verify_phase(model, W, sampling=True),
            "eagle_extend": lambda: eagle_draft_extend_phase(w.eagle, W),
            "eagle_decode": lambda: eagle_draft_decode_phase(w.eagle),
            "mtp": lambda: frozen_kv_mtp_phase(w.mtp),
            "token_batch": lambda: token_batch_phase(
                model.forward_token_batch, max_requests=TOKEN_REQUESTS
            ),
        }[phase]()
        self.forward = made.forward
        self.build(made, label, sizes, sanitizer)
        self._written = [] if phase == "mtp" else self._kv_names(draft=phase.startswith("eagle"))
        self.sinks = {name: [0] for name in self._written}
        read = [*self._kv_names(draft=False), *self._kv_names(draft=True)]
        self.padding_reads = dict.fromkeys(read, [0])

    def _kv_names(self, *, draft: bool) -> list[str]:
        if draft:
            return ["draft_k", "draft_v"]
        return [n for n in self.world.state() if n[0] in "kv" and n[1:].isdigit()]

    def inputs(self, raw_bs: int, seed: int) -> Any:
        w, phase = self.world, self.phase
        live = raw_bs
        if phase == "token_batch":
            live = 1 + seed % min(raw_bs, TOKEN_REQUESTS)
        requests = w.reset(live, seed)
        if phase == "verify":
            return w.verify_inputs(requests, W, seed)
        if phase == "sampled_verify":
            return sampled_verify_inputs(w.verify_inputs(requests, W, seed), W, self.vocab, seed)
        if phase == "eagle_extend":
            return w.eagle_inputs(requests, W, seed)
        if phase == "mtp":
            return w.mtp_inputs(requests, seed)
        if phase == "token_batch":  # raw_bs tokens over up to TOKEN_REQUESTS requests
            return w.token_batch(requests, raw_bs, seed)
        fields = w.tokens_step(requests, 1, seed)
        if phase == "sampled_decode":
            return with_sampling(SpecBatch(**fields), sampling_rows(raw_bs, seed, w.device))
        if phase == "eagle_decode":
            gen = torch.Generator().manual_seed(seed + 1)
            hidden = torch.randn(raw_bs, w.model.config.hidden_size, generator=gen)
            fields["hidden_states"] = hidden.to(w.device)
        return SpecBatch(**fields)

    def state(self) -> dict[str, torch.Tensor]:
        return self.world.state()

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        self.world.restore(state)

    def writable(self, inputs: Any) -> dict[str, list[int]]:
        if not self._written:
            return {}
        slots = sorted(set(inputs.out_cache_loc.tolist()))
        return dict.fromkeys(self._written, slots)

    def bystander(self) -> dict[str, int]:
        # SpecWorld.reset prefills its two bystanders first: request row 1 is one.
        slot = int(self.world.bundle.req_pool.req_to_token[1, 0])
        return {"request row": 1, "KV slot": slot, "Mamba slot": 1}

    def limits(self) -> dict[str, int]:
        b = self.world.bundle
        rows, ctx = b.req_pool.req_to_token.shape
        slots = b.kv_cache.k_buffers[0].shape[0]
        return _limits(self.vocab, rows, slots, ctx, slots)


MAMBA = MambaConfig(
    vocab_size=256,
    num_layers=2,
    mixer=MixerShape(
        hidden_size=32, intermediate_size=64, state_size=8, conv_kernel=4, time_step_rank=4
    ),
)
MAMBA_REQUESTS = 10
BYSTANDERS = 2


class MambaCase(FuzzCase):
    """The state-space decode of a small random Mamba-1 model: the decode
    fields plus each row's Mamba slot; the request pool's state ops run before
    launch. Live and bystander slots hold random state, free slots too."""

    def __init__(self, label: str, sizes: list[int], *, sanitize: bool = True) -> None:
        self.phase = "mamba_decode"
        torch.manual_seed(0)
        self.bundle = b = build_state_space_model(
            MAMBA, max_requests=MAMBA_REQUESTS, max_context_len=CONTEXT, device=device_of(label)
        )
        self.vocab = MAMBA.vocab_size
        sanitizer = None
        if sanitize:
            sanitizer = MambaSanitizer.for_pools(
                b.req_pool,
                None,
                kv_allocator=b.kv_alloc,
                mamba_pool=b.mamba_pool,
                vocab_size=self.vocab,
            )
        self.forward = b.model.forward_decode
        phase = decode_phase(b.model.forward_decode, backend=NullBackend(), mamba=True)
        self.build(phase, label, sizes, sanitizer, state_ops=b.req_pool)
        self.sinks = {}
        self.padding_reads = {"conv_state": [0], "ssm_state": [0]}

    def inputs(self, raw_bs: int, seed: int) -> Any:
        b, gen = self.bundle, torch.Generator().manual_seed(seed)
        b.req_pool.clear()
        b.kv_alloc.clear()
        b.mamba_pool.clear()
        rows, lens = [], []
        for _ in range(BYSTANDERS + raw_bs):
            (row,) = b.req_pool.alloc(1)
            n = int(torch.randint(1, 20, (), generator=gen))
            b.req_pool.write(row, 0, b.kv_alloc.alloc(n))
            rows.append(row)
            lens.append(n)
        b.mamba_pool.run_pending()  # the recorded clears, before the random state
        for t in (b.mamba_pool.conv_state, b.mamba_pool.ssm_state):
            t.copy_(torch.randn(t.shape, generator=gen))
        ids = torch.randint(0, self.vocab, (raw_bs,), generator=gen)
        batch = DecodeBatch.from_requests(
            rows[BYSTANDERS:],
            lens[BYSTANDERS:],
            ids.to(b.device),
            device=b.device,
            max_context_len=CONTEXT,
        )
        batch.prepare_decode(b.req_pool, b.kv_alloc)
        return state_space_inputs(batch, b.req_pool)

    def _tensors(self) -> dict[str, torch.Tensor]:
        b = self.bundle
        return {
            "req_to_token": b.req_pool.req_to_token,
            "conv_state": b.mamba_pool.conv_state,
            "ssm_state": b.mamba_pool.ssm_state,
        }

    def state(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self._tensors().items()}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        for n, t in self._tensors().items():
            t.copy_(state[n])

    def writable(self, inputs: Any) -> dict[str, list[int]]:
        slots = sorted(inputs.mamba_track_indices.tolist())
        return {"conv_state": slots, "ssm_state": slots}

    def bystander(self) -> dict[str, int]:
        b = self.bundle
        slot = int(b.req_pool.req_to_token[1, 0])
        return {"request row": 1, "KV slot": slot, "Mamba slot": b.req_pool.mamba_slots([1])[0]}

    def limits(self) -> dict[str, int]:
        b = self.bundle
        rows, ctx = b.req_pool.req_to_token.shape
        return _limits(self.vocab, rows, b.kv_alloc.size + 1, ctx, b.mamba_pool.size + 1)


def _limits(vocab: int, rows: int, slots: int, ctx: int, mamba_slots: int) -> dict[str, int]:
    return {
        "token": vocab,
        "request row": rows,
        "KV slot": slots,
        "Mamba slot": mamba_slots,
        "position": ctx,
        "length": ctx + 1,
        "count": W + 1,
    }


def make_case(phase: str, label: str, sizes: list[int], *, sanitize: bool = True) -> FuzzCase:
    """The captured runner of ``phase`` on mechanism ``label`` over its world."""
    if phase == "mamba_decode":
        return MambaCase(label, sizes, sanitize=sanitize)
    return SpecCase(phase, label, sizes, sanitize=sanitize)
