"""Linear attention with a recurrent state: the Gated DeltaNet mixer of hybrid MoE models (Qwen3-Next, Qwen3.5-MoE).

Per head, a state S [dk, dv] evolves token by token: ``S <- exp(g) S``, then the delta rule writes the part of v
that S does not already predict, ``S <- S + k (beta (v - S^T k))^T``, and the token reads ``o = S^T q`` (q, k
L2-normalised, q scaled by dk^-0.5). g (a per-head decay, <= 0) and beta (a write strength in (0, 1)) come from the
token. Before that, q / k / v pass a short causal depthwise conv1d (SiLU); after, a gated RMSNorm
(``norm(o) * silu(z)``) and the output projection.

Training and prefill use the chunked form (chunks of ``CHUNK`` tokens: the writes inside a chunk solve one
triangular system, chunks follow one another through S); decode uses the recurrent form, one token at a time. The
state math is fp32 whatever the model dtype. Packed rows (``attention_mask`` numbering its sequences 1, 2, ...) are
split into their sequences first, so the conv and the state restart at every sequence start; padding (0) never
enters either. In the rollout engine each row continues its sequence from its slot of ``LinearStates``
(``moerl.engine.kv_cache``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig
from moerl.model.linear import Linear

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_chunked(q, k, v, g, beta, state=None, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole sequences. q, k [B, T, H, dk] (normalised, q scaled), v [B, T, H, dv],
    g, beta [B, T, H]; ``state`` [B, H, dk, dv] or None (zeros). Returns (o [B, T, H, dv], final state), fp32.

    Within a chunk with cumulative log-decay G (G_i = g_1 + ... + g_i) and starting state S0, each write
    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) u_j): one unit lower-triangular
    system (I + A) U = beta V - beta exp(G) K S0 for the chunk. Then o_i = exp(G_i) S0^T q_i +
    sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j, and S_end = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T.
    """
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    n = (t + pad) // chunk

    # Laid out [chunk, B*H, token in chunk, ...] once: the recurrence over chunks is sequential, and each of its
    # steps is then a few whole-tensor ops (fused bmm's), few kernel launches per chunk.
    def chunks(x):  # [B, T, H, ...] -> [n, B*H, chunk, ...]; padding: no decay (g = 0), no write (beta = 0)
        x = F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(b, n, chunk, h, -1).permute(1, 0, 3, 2, 4).reshape(n, b * h, chunk, *x.shape[3:])

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    cum = g.cumsum(-1)  # G within each chunk
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # exp(G_i - G_j), j<=i
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]  # A (its diagonal is ignored: unit)
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w_v, w_k = solved.split([dv, dk], dim=-1)  # U = w_v - w_k S0
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
    chunk_decay = cum[..., -1:, None].exp()
    s = torch.zeros(b * h, dk, dv, device=q.device) if state is None else state.float().reshape(b * h, dk, dv)
    out = []  # unbind, not x[c]: one backward (a stack) per operand, not a zero-filled whole per chunk
    operands = (x.unbind(0) for x in (w_v, w_k, q_decayed, scores, chunk_decay, k_to_end))
    for w_v_c, w_k_c, q_c, scores_c, decay_c, k_c in zip(*operands, strict=True):
        u = torch.baddbmm(w_v_c, w_k_c, s, alpha=-1)
        out.append(torch.baddbmm(torch.bmm(q_c, s), scores_c, u))
        s = torch.baddbmm(s * decay_c, k_c, u)
    out = torch.stack(out).view(n, b, h, chunk, dv).permute(1, 0, 3, 2, 4).reshape(b, n * chunk, h, dv)
    return out[:, :t], s.view(b, h, dk, dv)


def delta_rule_step(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence (decode): q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv] fp32.
    Returns (o [B, H, dv], the new state)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = state * g.exp()[..., None, None]
    u = beta[..., None] * (v - (s * k[..., None]).sum(-2))
    s = s + k[..., None] * u[..., None, :]
    return (s * q[..., None]).sum(-2), s


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """Depthwise causal conv1d (``bias`` [C] or None) then SiLU: x [B, T, C], weight [C, 1, K]; ``state`` [B, C, K-1]
    holds the previous K-1 inputs (None: zeros). Returns (y [B, T, C], the last K-1 inputs as the next state: those up
    to each row's ``lengths`` [B] real inputs, when given, so padding after them stays out)."""
    kk = weight.shape[-1]
    xt = x.transpose(1, 2)
    past = torch.zeros(*xt.shape[:2], kk - 1, dtype=xt.dtype, device=xt.device) if state is None else state
    full = torch.cat([past.to(xt.dtype), xt], dim=-1)
    y = F.conv1d(full, weight.to(xt.dtype), None if bias is None else bias.to(xt.dtype), groups=xt.shape[1])
    if lengths is None:
        return F.silu(y).transpose(1, 2), full[..., full.shape[-1] - (kk - 1) :]
    at = lengths[:, None] + torch.arange(kk - 1, device=x.device)[None, :]  # full's columns [len, len + K - 1)
    return F.silu(y).transpose(1, 2), full.gather(2, at[:, None, :].expand(-1, full.shape[1], -1))


class GatedRMSNorm(nn.Module):
    """``rms_norm(x) * weight * silu(z)``, statistics and gate in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype) * self.weight
        return (y.float() * F.silu(z.float())).to(x.dtype)


def sequences(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sequence of packed rows lies: (index [N, L] into the flattened [B*T] tokens, valid [N, L]), one
    row per sequence (a row of a 0/1 mask is one sequence), its tokens in order, padded to the longest."""
    b, t = attention_mask.shape
    flat = attention_mask.reshape(-1).long()
    row = torch.arange(b, device=flat.device).repeat_interleave(t)
    seq_id = torch.where(flat > 0, row * (int(flat.max()) + 1) + flat, b * (int(flat.max()) + 1))  # padding: last
    _, lengths = torch.unique(seq_id[flat > 0], return_counts=True)
    tokens = torch.argsort(seq_id, stable=True)[: int(lengths.sum())]  # by sequence, in order within each
    width = int(lengths.max())
    start = torch.cumsum(lengths, 0) - lengths
    pos = torch.arange(width, device=flat.device)
    valid = pos[None, :] < lengths[:, None]
    index = torch.where(valid, (start[:, None] + pos[None, :]).clamp(max=len(tokens) - 1), 0)
    return tokens[index], valid


def per_sequence(forward, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A recurrent mixer's whole-sequence ``forward`` ([B, T, H] -> [B, T, H]) over packed rows: one row per
    sequence of ``mask`` (the forward's ``attention_mask``), so states and convs restart at each start and padding
    stays out; the outputs back in the rows' places (padding: 0)."""
    b, t, hdim = x.shape
    index, valid = sequences(mask)
    y = torch.zeros_like(x).view(b * t, hdim)
    y[index[valid]] = forward(x.reshape(b * t, hdim)[index] * valid[..., None])[valid]
    return y.view(b, t, hdim)


class RecurrentMixer(nn.Module):
    """What every recurrent mixer's call does (``moerl.model.mixers``): an engine step continues each row's sequence
    from its state slot (``_step``); a training / prefill forward runs each sequence of the packed rows whole
    (``_whole``), its state and conv starting fresh."""

    def forward(self, x, cos=None, sin=None, mask=None, cache=None) -> torch.Tensor:
        """x [B, T, H]; ``mask`` the forward's ``attention_mask`` (None: every row one whole sequence); ``cache``
        the engine's step (its rows continue their sequences from their state slots)."""
        if cache is not None:
            return self._step(x, cache)
        if mask is not None:
            return per_sequence(self._whole, x, mask)
        return self._whole(x)


class GatedDeltaNet(RecurrentMixer):
    """The linear-attention mixer of a ``linear`` layer (``ModelConfig.layer_types``)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        h = cfg.hidden_size
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = Linear(h, conv_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.nv, bias=False)
        self.in_proj_a = Linear(h, self.nv, bias=False)
        # its weight [C, 1, K] is what counts (causal_conv pads on the left itself)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.layer = layer

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A sequence's slot: the conv window [q/k/v channels, K-1] and the delta-rule state [Hv, dk, dv]."""
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
        conv_dim += cfg.linear_num_value_heads * cfg.linear_value_head_dim
        state = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return (conv_dim, cfg.linear_conv_kernel - 1), state

    def _heads(self, mixed: torch.Tensor, x: torch.Tensor):
        """q, k (normalised, q scaled, repeated to the value heads), v, g, beta from the conv output and x."""
        lead = mixed.shape[:-1]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (l2_normalize(z.float().view(*lead, self.nk, self.dk)) for z in (q, k))
        if self.nv > self.nk:
            q, k = (z.repeat_interleave(self.nv // self.nk, dim=-2) for z in (q, k))
        q = q * self.dk**-0.5
        v = v.view(*lead, self.nv, self.dv)
        beta = self.in_proj_b(x).float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return q, k, v, g, beta

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        z = self.in_proj_z(x).view(*o.shape[:-1], self.dv)
        return self.out_proj(self.norm(o.to(x.dtype), z).flatten(-2))

    def _whole(self, x: torch.Tensor) -> torch.Tensor:
        """Each row of x [B, T, H] one whole sequence."""
        mixed, _ = causal_conv(self.in_proj_qkv(x), self.conv1d.weight)
        q, k, v, g, beta = self._heads(mixed, x)
        o, _ = delta_rule_chunked(q, k, v, g, beta)
        return self._out(o, x)

    def _step(self, x: torch.Tensor, cache) -> torch.Tensor:
        """One engine step: each row's real tokens (``cache.real``) continue its sequence from its slot's conv
        window and state (``cache.state_slots``), which are written back; padding neither decays nor writes the
        state (g = 0, beta = 0) and stays out of the conv window. Prefill chunks take the chunked form, decode the
        recurrent step."""
        states, slots, real = cache.cache.states, cache.state_slots, cache.real
        conv_pool, state_pool = states.conv[self.layer], states.state[self.layer]
        inputs = self.in_proj_qkv(x) * real[..., None]
        mixed, window = causal_conv(inputs, self.conv1d.weight, conv_pool[slots], cache.lengths)
        conv_pool[slots] = window.to(conv_pool.dtype)
        q, k, v, g, beta = self._heads(mixed, x)
        g, beta = g * real[..., None], beta * real[..., None]
        if x.shape[1] == 1:
            o, new = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state_pool[slots])
            o = o[:, None]
        else:
            o, new = delta_rule_chunked(q, k, v, g, beta, state_pool[slots])
        state_pool[slots] = new
        return self._out(o, x)
