"""The Mamba-1 mixer of the reference models, and its state in a slot pool.

``in_proj -> causal conv window -> x_proj -> dt/B/C -> selective state update
-> gate -> out_proj``, op for op as transformers' torch path (``MambaMixer``
without CUDA kernels), so greedy tokens agree with it:

* decode (:meth:`MambaMixer.step`): one token per row; the conv window is the
  last ``conv_kernel`` inputs, the SSM state advances once;
* prefill (:meth:`MambaMixer.prefill`): one request's prompt from an empty
  state (zeros), scanned token by token as transformers does, returning the
  final conv window and SSM state to store in the request's slot.

Parameter names are transformers' (``in_proj``, ``conv1d``, ``x_proj``,
``dt_proj``, ``A_log``, ``D``, ``out_proj``; Jamba's mixer adds
``dt_layernorm``, ``b_layernorm``, ``c_layernorm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner import MambaStatePool
from graphrunner_ref.model.layers import RMSNorm

__all__ = [
    "MixerShape",
    "MambaMixer",
    "causal_conv",
    "conv_step",
    "gather_states",
    "write_states",
]


# The depthwise convolutions are products and sums, not F.conv1d: on a GPU,
# cuDNN may run a convolution in TF32, rounding differently from the float32
# transformers computes, and a sum over K (4) taps costs nothing.


def conv_step(
    window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The causal depthwise conv at each window's last position: window
    ``[bs, C, K]`` (oldest first), weight ``[C, 1, K]``, bias ``[C]`` -> ``[bs, C]``."""
    out = (window.to(weight.dtype) * weight[:, 0]).sum(-1)
    return out if bias is None else out + bias


def causal_conv(seq: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv of a sequence from zeros: seq ``[n, C]`` ->
    ``[n, C]`` (position ``t`` sees inputs ``t - K + 1 .. t``)."""
    n, k = seq.shape[0], weight.shape[-1]
    padded = F.pad(seq.to(weight.dtype).transpose(0, 1), (k - 1, 0))  # [C, n + K - 1]
    out = weight[:, 0, :1] * padded[:, :n]
    for j in range(1, k):
        out = out + weight[:, 0, j : j + 1] * padded[:, j : j + n]
    out = out if bias is None else out + bias[:, None]
    return out.transpose(0, 1)


@dataclass(frozen=True, slots=True)
class MixerShape:
    """The shape of one Mamba-1 mixer.

    ``bcdt_norm_eps``: Jamba's RMS norms on dt, B and C (None: plain Mamba).
    """

    hidden_size: int
    intermediate_size: int
    state_size: int
    conv_kernel: int
    time_step_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    bcdt_norm_eps: float | None = None

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One layer's conv window of one request: ``(intermediate, conv_kernel)``."""
        return (self.intermediate_size, self.conv_kernel)

    @property
    def ssm_state_shape(self) -> tuple[int, int]:
        """One layer's SSM state of one request: ``(intermediate, state_size)``."""
        return (self.intermediate_size, self.state_size)


class MambaMixer(nn.Module):
    """A Mamba-1 mixer: ``[n, hidden] -> [n, hidden]`` with a per-request state.

    State of one request: conv window ``[intermediate, conv_kernel]`` (the last
    ``conv_kernel`` conv inputs, oldest first) and SSM state
    ``[intermediate, state_size]`` (float32 arithmetic, stored in the pool's dtype).
    """

    def __init__(self, shape: MixerShape, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        s = shape
        self.shape = s
        inner = s.intermediate_size
        self.in_proj = nn.Linear(s.hidden_size, 2 * inner, bias=s.proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(
            inner, inner, s.conv_kernel, groups=inner, bias=s.conv_bias, dtype=dtype
        )
        self.x_proj = nn.Linear(inner, s.time_step_rank + 2 * s.state_size, bias=False, dtype=dtype)
        self.dt_proj = nn.Linear(s.time_step_rank, inner, bias=True, dtype=dtype)
        self.A_log = nn.Parameter(torch.zeros(inner, s.state_size, dtype=dtype))
        self.D = nn.Parameter(torch.ones(inner, dtype=dtype))
        self.out_proj = nn.Linear(inner, s.hidden_size, bias=s.proj_bias, dtype=dtype)
        self.norms: tuple[RMSNorm, RMSNorm, RMSNorm] | None = None
        if s.bcdt_norm_eps is not None:
            self.dt_layernorm = RMSNorm(s.time_step_rank, s.bcdt_norm_eps, dtype=dtype)
            self.b_layernorm = RMSNorm(s.state_size, s.bcdt_norm_eps, dtype=dtype)
            self.c_layernorm = RMSNorm(s.state_size, s.bcdt_norm_eps, dtype=dtype)
            self.norms = (self.dt_layernorm, self.b_layernorm, self.c_layernorm)

    def _dt_b_c(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``u [n, inner]`` (conv output) -> dt ``[n, inner]`` (softplus'd,
        float32), B and C ``[n, S]``."""
        s = self.shape
        dt, b, c = torch.split(self.x_proj(u), [s.time_step_rank, s.state_size, s.state_size], -1)
        if self.norms is not None:
            dt, b, c = (norm(t) for norm, t in zip(self.norms, (dt, b, c), strict=True))
        # transformers multiplies by dt_proj's weight and adds its bias in float32.
        dt = (self.dt_proj.weight @ dt.transpose(0, 1)).transpose(0, 1)
        dt = F.softplus(dt + self.dt_proj.bias.float())
        return dt, b, c

    def _a(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def step(
        self, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode token per row.

        x: ``[bs, hidden]``; conv ``[bs, inner, K]``; ssm ``[bs, inner, S]``.
        Returns the output ``[bs, hidden]`` and the new conv window and SSM
        state (new tensors; the caller decides which rows to store).
        """
        u, z = self.in_proj(x).chunk(2, dim=-1)
        window = torch.cat([conv[:, :, 1:], u.to(conv.dtype)[:, :, None]], dim=-1)
        u = F.silu(conv_step(window, self.conv1d.weight, self.conv1d.bias)).to(x.dtype)
        dt, b, c = self._dt_b_c(u)
        d_a = torch.exp(dt[..., None] * self._a())
        d_bx = (dt[..., None] * b.float()[:, None, :]) * u.float()[..., None]
        state = ssm.float() * d_a + d_bx
        y = torch.matmul(state.to(c.dtype), c[:, :, None])[..., 0]
        y = (y + u * self.D) * F.silu(z)
        return self.out_proj(y.to(x.dtype)), window, state.to(ssm.dtype)

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's ``n`` tokens from an empty state.

        x: ``[n, hidden]``. Returns the output ``[n, hidden]``, the final conv
        window ``[inner, K]`` and the final SSM state ``[inner, S]`` (float32).
        """
        n, k = x.shape[0], self.shape.conv_kernel
        u, z = self.in_proj(x).chunk(2, dim=-1)  # [n, inner] each
        window = F.pad(u.transpose(0, 1), (max(k - n, 0), 0))[:, -k:]  # last K inputs
        u = F.silu(causal_conv(u, self.conv1d.weight, self.conv1d.bias)).to(x.dtype)
        dt, b, c = self._dt_b_c(u)
        d_a = torch.exp(self._a()[None] * dt[..., None])  # [n, inner, S]
        d_bu = (dt[..., None] * b.float()[:, None, :]) * u.float()[..., None]
        state = torch.zeros_like(d_a[0])
        outs = []
        for t in range(n):  # the recurrence transformers runs without kernels
            state = d_a[t] * state + d_bu[t]
            outs.append(torch.matmul(state.to(x.dtype), c[t][:, None])[:, 0])
        y = (torch.stack(outs) + u * self.D) * F.silu(z)
        return self.out_proj(y.to(x.dtype)), window, state


def gather_states(pool: MambaStatePool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's state: conv ``[bs, L, inner, K]`` and ssm ``[bs, L, inner, S]``."""
    return pool.conv_state[slots], pool.ssm_state[slots]


def write_states(
    pool: MambaStatePool,
    slots: torch.Tensor,
    mask: torch.Tensor,
    new: tuple[torch.Tensor, torch.Tensor],
    old: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Store the new state of rows where ``mask`` (bool ``[bs]``) is True; rows
    where it is False (padding, all at slot 0) write back what they read, so
    the sink slot stays bit-identical. One ``index_copy_`` per tensor: static
    shapes, no host read, capturable."""
    for state, fresh, before in zip((pool.conv_state, pool.ssm_state), new, old, strict=True):
        keep = mask.view(-1, *[1] * (state.dim() - 1))
        state.index_copy_(0, slots, torch.where(keep, fresh.to(state.dtype), before))
