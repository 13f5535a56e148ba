"""The Mamba-2 mixer (``Mamba2ForCausalLM``): multi-head SSM with a scalar
decay per head, B and C shared by head groups, and a gated RMS norm.

``in_proj -> (gate, conv input, dt) -> causal conv window -> (x, B, C) ->
state update per head -> + D x -> gated norm -> out_proj``, as transformers'
torch path computes it. The same interface as
:class:`~graphrunner_ref.model.mamba_mixer.MambaMixer` (``step``, ``prefill``,
state shapes), so :class:`~graphrunner_ref.model.mamba.MambaLM` runs either.
Prefill scans token by token from a zero state: the same recurrence as
transformers' chunked scan, summed in another order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner_ref.model.mamba_mixer import causal_conv, conv_step

__all__ = ["Mamba2Mixer", "Mamba2Shape", "GatedRMSNorm"]


@dataclass(frozen=True, slots=True)
class Mamba2Shape:
    """The shape of one Mamba-2 mixer (``intermediate = num_heads * head_dim``)."""

    hidden_size: int
    intermediate_size: int
    state_size: int
    conv_kernel: int
    num_heads: int
    head_dim: int
    n_groups: int
    norm_eps: float = 1e-5
    conv_bias: bool = True
    proj_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise ValueError(
                f"num_heads {self.num_heads} x head_dim {self.head_dim} != intermediate_size "
                f"{self.intermediate_size}"
            )
        if self.num_heads % self.n_groups or self.intermediate_size % self.n_groups:
            raise ValueError(f"n_groups {self.n_groups} does not divide num_heads {self.num_heads}")

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One layer's conv window of one request: ``(conv_dim, conv_kernel)``."""
        return (self.conv_dim, self.conv_kernel)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """One layer's SSM state of one request: ``(num_heads, head_dim, state_size)``."""
        return (self.num_heads, self.head_dim, self.state_size)


class GatedRMSNorm(nn.Module):
    """``norm(y * silu(gate))`` per group of ``group_size`` channels, in float32."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer: ``[n, hidden] -> [n, hidden]`` with a per-request state:
    conv window ``[conv_dim, K]`` and SSM state ``[heads, head_dim, S]``."""

    def __init__(self, shape: Mamba2Shape, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        s = shape
        self.shape = s
        proj = 2 * s.intermediate_size + 2 * s.n_groups * s.state_size + s.num_heads
        self.in_proj = nn.Linear(s.hidden_size, proj, bias=s.proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.conv_bias, dtype=dtype
        )
        self.dt_bias = nn.Parameter(torch.ones(s.num_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.ones(s.num_heads, dtype=dtype))
        group = s.intermediate_size // s.n_groups
        self.norm = GatedRMSNorm(s.intermediate_size, group, s.norm_eps, dtype)
        self.out_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.proj_bias, dtype=dtype)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        gate, xbc, dt = self.in_proj(x).split([s.intermediate_size, s.conv_dim, s.num_heads], -1)
        return gate, xbc, dt

    def _heads(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output ``[n, conv_dim]`` -> x ``[n, H, P]``, B and C ``[n, H, S]``
        (each group's B and C repeated for its heads)."""
        s = self.shape
        gs = s.n_groups * s.state_size
        x, b, c = torch.split(xbc, [s.intermediate_size, gs, gs], dim=-1)
        return x.reshape(-1, s.num_heads, s.head_dim), self._per_head(b), self._per_head(c)

    def _per_head(self, t: torch.Tensor) -> torch.Tensor:
        """``[n, groups * S]`` -> ``[n, H, S]``, each group's row repeated for
        its heads: an expand, static and sync-free (capturable)."""
        s = self.shape
        rep = s.num_heads // s.n_groups
        t = t.reshape(-1, s.n_groups, 1, s.state_size).expand(-1, -1, rep, -1)
        return t.reshape(-1, s.num_heads, s.state_size)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        return F.silu(conv_step(window, self.conv1d.weight, self.conv1d.bias))

    def step(
        self, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode token per row: x ``[bs, hidden]``, conv ``[bs, conv_dim, K]``,
        ssm ``[bs, H, P, S]``; returns the output and the new conv and SSM state."""
        gate, xbc, dt = self._split(x)
        window = torch.cat([conv[:, :, 1:], xbc.to(conv.dtype)[:, :, None]], dim=-1)
        xs, b, c = self._heads(self._conv(window).to(x.dtype))
        dt = F.softplus(dt + self.dt_bias)[..., None, None]  # [bs, H, 1, 1]
        d_a = torch.exp(dt.float() * -torch.exp(self.A_log.float())[:, None, None])
        d_bx = (dt * b[:, :, None, :]) * xs[..., None]
        state = ssm * d_a + d_bx
        y = torch.bmm(
            state.reshape(-1, self.shape.head_dim, self.shape.state_size),
            c.reshape(-1, self.shape.state_size, 1),
        )
        y = y.view_as(xs) + xs * self.D[:, None]
        y = self.norm(y.reshape(x.shape[0], -1), gate)
        return self.out_proj(y.to(x.dtype)), window, state.to(ssm.dtype)

    def prefill(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's ``n`` tokens from a zero state: output ``[n, hidden]``,
        final conv window ``[conv_dim, K]`` and SSM state ``[H, P, S]`` (float32)."""
        n, k = x.shape[0], self.shape.conv_kernel
        gate, xbc, dt = self._split(x)
        window = F.pad(xbc.transpose(0, 1), (max(k - n, 0), 0))[:, -k:]  # last K inputs
        conv = causal_conv(xbc, self.conv1d.weight, self.conv1d.bias)
        xs, b, c = self._heads(F.silu(conv).to(x.dtype))
        dt = F.softplus(dt + self.dt_bias).float()  # [n, H]
        d_a = torch.exp(dt * -torch.exp(self.A_log.float()))  # [n, H]
        state = torch.zeros(self.shape.ssm_state_shape, dtype=torch.float32, device=x.device)
        outs = []
        for t in range(n):
            d_bx = (dt[t][:, None, None] * b[t].float()[:, None, :]) * xs[t].float()[..., None]
            state = state * d_a[t][:, None, None] + d_bx
            outs.append(torch.matmul(state, c[t].float()[:, :, None])[..., 0])
        y = torch.stack(outs) + xs.float() * self.D.float()[:, None]
        y = self.norm(y.reshape(n, -1).to(x.dtype), gate)
        return self.out_proj(y), window, state
