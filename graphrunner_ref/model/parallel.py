"""Tensor parallelism: the collectives a sharded model calls, and how it is sharded.

The collectives are torch's functional collectives
(:mod:`torch.distributed._functional_collectives`): ops that return a new
tensor, which dynamo traces and inductor keeps in its programs (and CUDA graphs
can capture, on NCCL), rather than in-place ``dist.all_reduce`` calls that
break a graph. Alone (one rank, not ``communicate_alone``) every collective
is the identity, so a model built with :data:`SINGLE` runs exactly the ops it
ran before.

Sharding (Megatron-style, as vLLM and SGLang do): q/k/v and gate/up are
column-parallel (each rank holds its heads' rows, its slice of the
intermediate rows), o_proj and down_proj row-parallel (each rank holds the
matching columns; their partial sums are all-reduced), the embedding and LM
head vocabulary-parallel (each rank holds ``vocab / world`` rows; embeddings
are all-reduced, logits all-gathered). When there are fewer KV heads than
ranks, each KV head is replicated on ``world / num_kv_heads`` ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from graphrunner_ref.model.config import ModelConfig

# torch 2.13 names it all_gather_single (all_gather_tensor stays, deprecated);
# older releases (the GPU image's 2.11) have only all_gather_tensor.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

__all__ = [
    "SINGLE",
    "TensorParallel",
    "VocabParallelEmbedding",
    "check_shardable",
    "kv_head_range",
    "local_config",
    "pad_vocab_shard",
    "shard_slice",
    "shard_weights",
    "vocab_shard",
]


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: ``rank`` of ``world``.

    ``group``: the process group the collectives run over (``None``: the
    default group, which must be initialised before the first collective when
    ``world > 1``). With ``world == 1`` nothing is communicated, unless
    ``communicate_alone``: then the one rank runs the sharded model's
    collectives over its group of one (``--tp 1``: the path TP = N takes,
    compiled and captured, with the numbers of one process).
    """

    rank: int = 0
    world: int = 1
    group: dist.ProcessGroup | None = None
    communicate_alone: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"TensorParallel.world={self.world!r}: expected an int >= 1")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError(f"TensorParallel.rank={self.rank!r}: expected an int")
        if not 0 <= self.rank < self.world:
            raise ValueError(
                f"TensorParallel.rank={self.rank}: expected 0..world - 1 = {self.world - 1}"
            )
        if not isinstance(self.communicate_alone, bool):
            raise ValueError(
                f"TensorParallel.communicate_alone={self.communicate_alone!r}: expected a bool"
            )

    @property
    def alone(self) -> bool:
        """Whether the collectives are skipped (one rank, not ``communicate_alone``)."""
        return self.world == 1 and not self.communicate_alone

    def _group(self) -> dist.ProcessGroup:
        group = dist.group.WORLD if self.group is None else self.group
        if group is None:
            raise RuntimeError(
                f"TensorParallel(world={self.world}) has no process group: expected "
                "torch.distributed.init_process_group before the first collective"
            )
        return group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (same shape), a new tensor; ``x`` itself when alone."""
        if self.alone:
            return x
        return _waited(funcol.all_reduce(x, "sum", self._group()))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [..., n]`` concatenated in rank order along the last
        dim: ``[..., world * n]``; ``x`` itself when alone."""
        if self.alone:
            return x
        return _waited(_all_gather(x, x.dim() - 1, self._group()))

    def broadcast(self, value: list[int]) -> list[int]:
        """Rank 0's ``value`` on every rank: a host-side exchange (not for a
        captured step); ``value`` itself with one rank."""
        if self.world == 1:
            return list(value)
        box: list[list[int] | None] = [list(value)]
        group = self._group()
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return list(box[0] or [])

    def agree(self, what: str, value: list[int]) -> None:
        """Raise ``ValueError`` on every rank unless every rank passed the same
        ``value``; the message names ``what`` and each rank's value. A host-side
        exchange (not for a captured step); nothing with one rank."""
        if self.world == 1:
            return
        found: list[list[int] | None] = [None] * self.world
        dist.all_gather_object(found, list(value), group=self._group())
        if any(v != found[0] for v in found):
            each = ", ".join(f"rank {r} {v}" for r, v in enumerate(found))
            raise ValueError(
                f"{what} differ across tensor-parallel ranks: {each}; expected the "
                "same on every rank (ranks that disagree would wait on each other's "
                "collectives)"
            )


#: One process, no communication.
SINGLE = TensorParallel()


def _waited(x: torch.Tensor) -> torch.Tensor:
    # Eager functional collectives return an AsyncCollectiveTensor; wait here so
    # callers hold a plain tensor (traced, they are plain tensors already).
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def check_shardable(config: ModelConfig, tp: TensorParallel) -> None:
    """Raise ``ValueError`` naming the field when ``config`` cannot be split ``tp.world`` ways."""
    w = tp.world
    if w > 1 and (config.attention_bias or config.mlp_bias):
        raise ValueError(
            f"ModelConfig.attention_bias={config.attention_bias}, mlp_bias={config.mlp_bias}: "
            f"biases are not sharded; expected a bias-free model for tensor-parallel world {w}"
        )
    for name in ("num_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % w:
            raise ValueError(
                f"ModelConfig.{name}={value}: expected a multiple of the tensor-parallel "
                f"world size {w}"
            )
    kv = config.num_kv_heads
    if kv % w and w % kv:
        raise ValueError(
            f"ModelConfig.num_kv_heads={kv}: expected a multiple or a divisor of the "
            f"tensor-parallel world size {w}"
        )


def vocab_shard(config: ModelConfig, tp: TensorParallel) -> int:
    """Vocabulary rows each rank holds: ``ceil(vocab_size / world)``. A
    vocabulary the world size does not divide is padded at its end (as
    vLLM's vocabulary-parallel embedding does): the padded rows hold zeros,
    no token id reaches them, and their logits are cut off after the gather."""
    return -(-config.vocab_size // tp.world)


#: The transformers names of the tensors sharded by vocabulary row.
_VOCAB_TENSORS = ("embed_tokens", "lm_head")


def _leaf(name: str) -> str:
    return name.removesuffix(".weight").rsplit(".", 1)[-1]


def pad_vocab_shard(
    name: str, tensor: torch.Tensor, config: ModelConfig, tp: TensorParallel
) -> torch.Tensor:
    """Rank ``tp.rank``'s slice of vocabulary tensor ``name`` with zero rows
    appended up to :func:`vocab_shard` (the padding past the vocabulary);
    any other tensor unchanged."""
    rows = vocab_shard(config, tp)
    if _leaf(name) not in _VOCAB_TENSORS or tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def kv_head_range(config: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """``(first, count)``: the KV heads rank ``tp.rank`` holds (replicated when
    there are fewer KV heads than ranks)."""
    kv, w = config.num_kv_heads, tp.world
    if kv >= w:
        return tp.rank * (kv // w), kv // w
    return tp.rank // (w // kv), 1


def local_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shape one rank's layers hold: its query heads, its KV heads, its slice
    of the MLP (``head_dim`` given, not derived). Vocabulary and hidden size stay
    whole: the model's outputs are the full model's."""
    check_shardable(config, tp)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp.world,
        num_kv_heads=kv_head_range(config, tp)[1],
        intermediate_size=config.intermediate_size // tp.world,
        head_dim=config.head_dim,
    )


def shard_slice(name: str, config: ModelConfig, tp: TensorParallel) -> tuple[int, int, int] | None:
    """``(dim, start, length)``: the slice of the full tensor ``name`` (a
    transformers Llama name) rank ``tp.rank`` holds, or None when it holds it
    whole (norms). A vocabulary slice of the last ranks may be shorter than
    :func:`vocab_shard` (:func:`pad_vocab_shard` pads it)."""
    check_shardable(config, tp)
    d, r, w = config.head_dim, tp.rank, tp.world
    q_rows = config.num_heads // w * d
    kv_first, kv_count = kv_head_range(config, tp)
    inter = config.intermediate_size // w
    vocab = vocab_shard(config, tp)
    vocab_rows = max(0, min(vocab, config.vocab_size - r * vocab))
    slices = {
        "q_proj": (0, r * q_rows, q_rows),
        "k_proj": (0, kv_first * d, kv_count * d),
        "v_proj": (0, kv_first * d, kv_count * d),
        "gate_proj": (0, r * inter, inter),
        "up_proj": (0, r * inter, inter),
        "embed_tokens": (0, r * vocab, vocab_rows),
        "lm_head": (0, r * vocab, vocab_rows),
        "o_proj": (1, r * q_rows, q_rows),
        "down_proj": (1, r * inter, inter),
    }
    return slices.get(_leaf(name))


def shard_weights(
    weights: Mapping[str, torch.Tensor], config: ModelConfig, tp: TensorParallel
) -> dict[str, torch.Tensor]:
    """Rank ``tp.rank``'s slices (:func:`shard_slice`) of a full transformers-named
    Llama state dict; tensors it holds whole are passed through."""
    out = {}
    for name, tensor in weights.items():
        where = shard_slice(name, config, tp)
        part = tensor if where is None else tensor.narrow(*where).contiguous()
        out[name] = pad_vocab_shard(name, part, config, tp)
    return out


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding rows ``[rank * n, (rank + 1) * n)`` of a ``world * n``
    vocabulary (``n = ceil(vocab_size / world)``, rows past the vocabulary
    zero): ``ids [...]`` int64 to ``[..., dim]``, the rows other ranks hold
    summed in by an all-reduce. Alone (:attr:`TensorParallel.alone`): an nn.Embedding."""

    def __init__(
        self, vocab_size: int, dim: int, tp: TensorParallel, *, dtype: torch.dtype | None = None
    ) -> None:
        rows = -(-vocab_size // tp.world)  # padded past the vocabulary (vocab_shard)
        super().__init__(rows, dim, dtype=dtype)
        self.tp = tp
        self.first = tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.alone:
            return super().forward(ids)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(local * mine, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(rows)
