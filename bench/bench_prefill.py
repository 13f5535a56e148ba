"""Time to first token of one prompt: graphrunner's eager prefill
(``forward_extend``, its attention torch's fused ``scaled_dot_product_attention``,
causal) against the materialised-scores attention it replaced (the gathered
path: matmul, mask, float32 softmax, matmul) and against transformers' own
forward of the same checkpoint, SmolLM2-135M, one thread, float32, prompts of
128, 512 and 2,048 tokens, each the best of ``--repeats`` runs.

    PYTHONPATH=. .venv/bin/python -m bench.bench_prefill
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.conftest import machine
from graphrunner.util.atomic import write_atomically
from graphrunner_ref.model.attention import PagedAttention
from graphrunner_ref.model.attention_meta import AttnMetadata, attend

CMD = "PYTHONPATH=. .venv/bin/python -m bench.bench_prefill"
RESULTS = Path(__file__).parent / "results"
LENGTHS = (128, 512, 2048)


def _materialised(
    self: PagedAttention,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    meta: AttnMetadata,
) -> torch.Tensor:
    """The prompt attention before the fused one: the gathered path, every
    ``[R, T]`` score written out, masked and softmaxed."""
    out = attend(self._rows(q, 1), k_buf, v_buf, meta, self.scale)
    return self._unrows(out, q.shape[0])


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from bench.bench_context import smollm2_chats
    from graphrunner_ref.io import load_model

    checkpoint, _ = smollm2_chats()
    bundle = load_model(checkpoint, max_requests=1, max_context_len=max(LENGTHS))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    fused = PagedAttention._prompt
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(3, bundle.config.vocab_size, (n,), generator=gen)
        row = bundle.req_pool.alloc(1)[0]
        slots = torch.tensor(bundle.kv_alloc.alloc(n))

        def ours(ids: torch.Tensor = ids, row: int = row, slots: torch.Tensor = slots) -> None:
            bundle.model.forward_extend(row, ids, slots)

        def theirs(ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                hf(ids[None]).logits[0, -1]

        new = best_of(ours, args.repeats)
        PagedAttention._prompt = _materialised  # type: ignore[method-assign]
        try:
            old = best_of(ours, args.repeats)
        finally:
            PagedAttention._prompt = fused  # type: ignore[method-assign]
        hf_s = best_of(theirs, args.repeats)
        bundle.kv_alloc.free(slots.tolist())
        bundle.req_pool.free([row])
        rows.append({"tokens": n, "fused_s": new, "materialised_s": old, "transformers_s": hf_s})
        print(
            f"{n} tokens: fused {new:.2f} s, materialised {old:.2f} s ({old / new:.2f}x), "
            f"transformers {hf_s:.2f} s (ours / theirs {hf_s / new:.2f}x)"
        )
    _write(rows)


def _write(rows: list[dict[str, Any]]) -> None:
    info = {**machine(), "path": "eager forward_extend, float32, 1 thread", "command": CMD}
    lines = [
        "# Prefill: time to first token of one prompt, SmolLM2-135M",
        "",
        *(f"- {k}: {v}" for k, v in info.items()),
        "",
        "| prompt tokens | graphrunner (fused attention) s | before (materialised scores) s "
        "| speed-up | transformers forward s | transformers / graphrunner |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['fused_s']:.2f} | {r['materialised_s']:.2f} | "
            f"{r['materialised_s'] / r['fused_s']:.2f}x | {r['transformers_s']:.2f} | "
            f"{r['transformers_s'] / r['fused_s']:.2f}x |"
        )
    write_atomically(RESULTS / "prefill-smollm2-cpu.md", "\n".join(lines) + "\n")
    write_atomically(
        RESULTS / "prefill-smollm2-cpu.json", json.dumps({**info, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
