"""Mamba-2 layers (the state-space mixer of Granite-4.0-H, Nemotron-H): a ``mamba`` layer of ``layer_types``.

Per head h, a state S [head_dim, state] evolves token by token: ``S <- exp(dt A_h) S + dt x B^T`` and the token reads
``y = S C + D_h x``, with dt = softplus(its projection + dt_bias) (clamped to the configured limits), A_h = -exp(A_log),
B and C shared by the heads of a group. Before that, x / B / C pass a short causal depthwise conv1d (with its bias,
then SiLU); after, a gated RMSNorm (``norm(y * silu(z))`` over ``mamba_norm_groups`` groups of channels) and the
output projection. Training and prefill use the chunked (SSD) form, decode the recurrent step; the state math is
fp32 whatever the model dtype. Packed rows are split into their sequences (the conv and the state restart at every
start, padding never enters either), and in the rollout engine each row continues its sequence from its slot of
``LinearStates`` (``moerl.engine.kv_cache``), as Gated DeltaNet's do (``moerl.model.linear_attention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig
from moerl.model.linear import Linear
from moerl.model.linear_attention import RecurrentMixer, causal_conv

CHUNK = 64


def ssd_chunked(x, dt, a, b, c, state=None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 recurrence over whole sequences. x [B, T, H, P], dt [B, T, H] (after softplus), a [H] (< 0),
    b, c [B, T, H, N] (each head's group's); ``state`` [B, H, P, N] or None (zeros). Returns (y [B, T, H, P] without
    the D term, the final state), fp32.

    Within a chunk with cumulative log-decay G (G_i = dt_1 a + ... + dt_i a) and starting state S0:
    y_i = exp(G_i) S0 c_i + sum_{j<=i} exp(G_i - G_j) (c_i . b_j) dt_j x_j, and
    S_end = exp(G_C) S0 + sum_j exp(G_C - G_j) dt_j x_j b_j^T.
    """
    bs, t, h, p = x.shape
    n = b.shape[-1]
    pad = -t % chunk
    chunks_n = (t + pad) // chunk

    def chunks(z):  # [B, T, H, ...] -> [n, B*H, chunk, ...]; padding: no decay, no write
        z = F.pad(z.float(), (0, 0) * (z.dim() - 2) + (0, pad))
        return z.reshape(bs, chunks_n, chunk, h, -1).permute(1, 0, 3, 2, 4).reshape(chunks_n, bs * h, chunk, -1)

    xs, bc, cc = map(chunks, (x * dt[..., None], b, c))
    cum = chunks((dt * a)[..., None]).squeeze(-1).cumsum(-1)  # G within each chunk
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    scores = (cc @ bc.transpose(-1, -2)) * decay  # [n, B*H, chunk, chunk]
    c_decayed = cc * cum.exp()[..., None]
    b_to_end = (bc * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # [n, B*H, N, chunk]
    chunk_decay = cum[..., -1:, None].exp()
    s = torch.zeros(bs * h, n, p, device=x.device) if state is None else state.float().transpose(-1, -2)
    s = s.reshape(bs * h, n, p)
    out = []
    operands = (z.unbind(0) for z in (xs, scores, c_decayed, b_to_end, chunk_decay))
    for xs_c, scores_c, c_c, b_c, decay_c in zip(*operands, strict=True):
        out.append(torch.baddbmm(torch.bmm(c_c, s), scores_c, xs_c))
        s = torch.baddbmm(s * decay_c, b_c, xs_c)
    y = torch.stack(out).view(chunks_n, bs, h, chunk, p).permute(1, 0, 3, 2, 4).reshape(bs, chunks_n * chunk, h, p)
    return y[:, :t], s.view(bs, h, n, p).transpose(-1, -2)


def ssd_step(x, dt, a, b, c, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode): x [B, H, P], dt [B, H], a [H], b, c [B, H, N], state [B, H, P, N] fp32.
    Returns (y [B, H, P] without the D term, the new state)."""
    x, dt, b, c = (z.float() for z in (x, dt, b, c))
    s = state * (dt * a).exp()[..., None, None] + (x * dt[..., None])[..., None] * b[:, :, None, :]
    return (s * c[:, :, None, :]).sum(-1), s


class GroupGatedRMSNorm(nn.Module):
    """``rms_norm(x * silu(z))`` over ``groups`` equal groups of channels, then the weight; fp32 inside."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(z.float())
        h = h.unflatten(-1, (self.groups, -1))
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * h.to(x.dtype)


class Mamba2(RecurrentMixer):
    """The state-space mixer of a ``mamba`` layer (``ModelConfig.layer_types``)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.state, self.groups = cfg.mamba_state_size, cfg.mamba_groups
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.groups * self.state
        self.in_proj = Linear(h, self.inner + self.conv_dim + self.heads, bias=cfg.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, cfg.mamba_conv_kernel, groups=self.conv_dim, bias=cfg.mamba_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = GroupGatedRMSNorm(self.inner, cfg.mamba_norm_groups, cfg.rms_norm_eps)
        self.out_proj = Linear(self.inner, h, bias=cfg.mamba_proj_bias)
        self.dt_limit = (cfg.mamba_dt_min, cfg.mamba_dt_max)
        self.layer = layer

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A sequence's slot: the conv window [conv channels, K-1] and the state [heads, head_dim, state]."""
        conv_dim = cfg.mamba_num_heads * cfg.mamba_head_dim + 2 * cfg.mamba_groups * cfg.mamba_state_size
        return (conv_dim, cfg.mamba_conv_kernel - 1), (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size)

    def _parts(self, x: torch.Tensor):
        """(z, the conv's input, dt) from the layer input."""
        return self.in_proj(x).split([self.inner, self.conv_dim, self.heads], dim=-1)

    def _ssm_inputs(self, mixed: torch.Tensor, dt: torch.Tensor):
        """x [.., H, P], dt (softplus, clamped; fp32), b, c [.., H, N] (each head's group's) from the conv output."""
        lead = mixed.shape[:-1]
        xs, b, c = mixed.split([self.inner, self.groups * self.state, self.groups * self.state], dim=-1)
        b, c = (z.view(*lead, self.groups, self.state).repeat_interleave(self.heads // self.groups, -2) for z in (b, c))
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.dt_limit != (0.0, float("inf")):
            dt = dt.clamp(*self.dt_limit)
        return xs.view(*lead, self.heads, self.head_dim), dt, b, c

    def _out(self, y: torch.Tensor, xs: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y + xs.float() * self.D.float()[:, None]
        return self.out_proj(self.norm(y.flatten(-2), z).to(z.dtype))

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """Each row of x [B, T, H] one whole sequence."""
        z, conv_in, dt = self._parts(x)
        mixed, _ = causal_conv(conv_in, self.conv1d.weight, bias=self.conv1d.bias)
        xs, dt, bb, cc = self._ssm_inputs(mixed, dt)
        y, _ = ssd_chunked(xs, dt, -self.A_log.float().exp(), bb, cc)
        return self._out(y, xs, z)

    def _step(self, x: torch.Tensor, cache) -> torch.Tensor:
        """One engine step: each row's real tokens (``cache.real``) continue its sequence from its slot's conv
        window and state (``cache.state_slots``), which are written back; padding neither decays nor writes the
        state (dt = 0) and stays out of the conv window."""
        states, slots, real = cache.cache.states, cache.state_slots, cache.real
        conv_pool, state_pool = states.conv[self.layer], states.state[self.layer]
        z, conv_in, dt = self._parts(x)
        mixed, window = causal_conv(
            conv_in * real[..., None], self.conv1d.weight, conv_pool[slots], cache.lengths, bias=self.conv1d.bias
        )
        conv_pool[slots] = window.to(conv_pool.dtype)
        xs, dt, bb, cc = self._ssm_inputs(mixed, dt)
        dt = dt * real[..., None]
        a = -self.A_log.float().exp()
        if x.shape[1] == 1:
            y, new = ssd_step(xs[:, 0], dt[:, 0], a, bb[:, 0], cc[:, 0], state_pool[slots])
            y = y[:, None]
        else:
            y, new = ssd_chunked(xs, dt, a, bb, cc, state_pool[slots])
        state_pool[slots] = new
        return self._out(y, xs, z)
