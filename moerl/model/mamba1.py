"""Mamba-1 layers (Jamba's selective state space): a ``mamba1`` layer of ``layer_types``.

Each of the I inner channels c keeps a state s_c [N] that evolves token by token: ``s_c <- exp(dt_c A_c) * s_c +
dt_c x_c B`` (A_c [N] = -exp(A_log[c]): a decay per channel and state dim, unlike Mamba-2's one per head) and the
token reads ``y_c = s_c . C + D_c x_c``, gated by ``silu(z_c)``. x and the gate z come from ``in_proj``; x passes a
short causal depthwise conv1d (bias, then SiLU); ``x_proj`` of the conv output gives the step's low-rank input and B,
C, each through its own RMSNorm (Jamba's dt / B / C norms), and ``dt = softplus(dt_proj(...))``. The state math is
fp32 whatever the model dtype. Packed rows, padding and the engine's state slots work as for Mamba-2
(``moerl.model.mamba``): padding neither decays nor writes the state (dt = 0) and stays out of the conv window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig
from moerl.model.linear import Linear
from moerl.model.linear_attention import RecurrentMixer, causal_conv


def selective_scan(x, dt, a, b, c, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-1 recurrence: x, dt [B, T, I] (dt after its softplus), a [I, N] (< 0), b, c [B, T, N]; ``state``
    [B, I, N] or None (zeros). Returns (y [B, T, I] without the D term and the gate, the final state), fp32.

    One fused multiply-add a token: the decay and the write are formed for the whole sequence first, and the outputs
    read from the stacked states in one product (a state per channel and state dim leaves no chunked matmul form
    as cheap as Mamba-2's)."""
    x, dt, b, c = (z.float() for z in (x, dt, b, c))
    decay = (dt[..., None] * a).exp()  # [B, T, I, N]
    write = (dt * x)[..., None] * b[:, :, None, :]
    s = x.new_zeros(x.shape[0], *a.shape) if state is None else state.float()
    states = []
    for t in range(x.shape[1]):
        s = torch.addcmul(write[:, t], decay[:, t], s)
        states.append(s)
    y = (torch.stack(states, 1) @ c[..., None]).squeeze(-1)
    return y, s


class RMSNormInDtype(nn.Module):
    """RMSNorm as Jamba's dt / B / C norms compute it: statistics in fp32, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Mamba1(RecurrentMixer):
    """The selective state-space mixer of a ``mamba1`` layer (``ModelConfig.layer_types``).

    ``dt_proj`` is a plain ``nn.Linear``, not a ``Linear`` a training mode swaps: transformers applies its weight
    directly (an adapter on it would not reach a PEFT export), and its rank-sized input is too small for MXFP8's
    blocks of 32."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h, self.inner, self.state = cfg.hidden_size, cfg.mamba_inner_size, cfg.mamba_state_size
        self.rank = cfg.mamba_dt_rank
        self.in_proj = Linear(h, 2 * self.inner, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            self.inner, self.inner, cfg.mamba_conv_kernel, groups=self.inner, bias=cfg.mamba_conv_bias
        )
        self.x_proj = Linear(self.inner, self.rank + 2 * self.state, bias=False)
        self.dt_proj = nn.Linear(self.rank, self.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.state))
        self.D = nn.Parameter(torch.ones(self.inner))
        self.out_proj = Linear(self.inner, h, bias=cfg.mamba_proj_bias)
        self.dt_layernorm = RMSNormInDtype(self.rank, cfg.rms_norm_eps)
        self.b_layernorm = RMSNormInDtype(self.state, cfg.rms_norm_eps)
        self.c_layernorm = RMSNormInDtype(self.state, cfg.rms_norm_eps)
        self.layer = layer

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A sequence's slot: the conv window [inner channels, K-1] and the state [inner channels, state]."""
        return (cfg.mamba_inner_size, cfg.mamba_conv_kernel - 1), (cfg.mamba_inner_size, cfg.mamba_state_size)

    def _ssm_inputs(self, mixed: torch.Tensor):
        """dt (after its softplus, fp32), B and C from the conv output."""
        dt, b, c = self.x_proj(mixed).split([self.rank, self.state, self.state], dim=-1)
        dt = F.softplus(self.dt_proj(self.dt_layernorm(dt)).float())
        return dt, self.b_layernorm(b), self.c_layernorm(c)

    def _out(self, y: torch.Tensor, xs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = (y + xs.float() * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(z.dtype))

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """Each row of x [B, T, H] one whole sequence."""
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        mixed, _ = causal_conv(xs, self.conv1d.weight, bias=self.conv1d.bias)
        dt, b, c = self._ssm_inputs(mixed)
        y, _ = selective_scan(mixed, dt, -self.A_log.float().exp(), b, c)
        return self._out(y, mixed, z)

    def _step(self, x: torch.Tensor, cache) -> torch.Tensor:
        """One engine step: each row's real tokens (``cache.real``) continue its sequence from its slot's conv
        window and state (``cache.state_slots``), which are written back."""
        states, slots, real = cache.cache.states, cache.state_slots, cache.real
        conv_pool, state_pool = states.conv[self.layer], states.state[self.layer]
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        mixed, window = causal_conv(
            xs * real[..., None], self.conv1d.weight, conv_pool[slots], cache.lengths, bias=self.conv1d.bias
        )
        conv_pool[slots] = window.to(conv_pool.dtype)
        dt, b, c = self._ssm_inputs(mixed)
        y, new = selective_scan(mixed, dt * real[..., None], -self.A_log.float().exp(), b, c, state_pool[slots])
        state_pool[slots] = new
        return self._out(y, mixed, z)
