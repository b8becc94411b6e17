"""DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5): per latent-attention layer, a few small
heads score every key a query may see, and the query attends to its ``index_topk`` best keys only.

The score of key s for query t is ``sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(d))`` with ``w`` a projection of the
query token (times ``heads ** -0.5``), ``q`` projected from the attention's low-rank query (after its norm) and one
key per token (LayerNorm'd, rotated on its first ``qk_rope_head_dim`` dims). The selection is discrete: no gradient
reaches the indexer through it, and transformers defines no loss of its own for it (DeepSeek trains it apart with a
KL to the dense attention), so its weights stay as loaded in every training mode (plain ``nn.Linear``: no LoRA, no
MX). Scores in fp32 as transformers computes them; keys tied at a score of exactly 0 go to the later one (see
``select``), where transformers' top-k picks by its own layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moerl.model.config import ModelConfig
from moerl.model.rope import apply_rope

INDEX_NORM_EPS = 1e-6  # the key LayerNorm's epsilon (DeepSeek-V3.2's reference code)


class Indexer(nn.Module):
    """Chooses the keys each query of a latent-attention layer attends to (``select``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim, self.interleave = cfg.qk_rope_head_dim, cfg.index_rope_interleave
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.scale = self.dim**-0.5

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """RoPE on the first ``rope_dim`` dims of each head of ``x`` [B, T, H, d] (q and k alike: their dot
        products are those of transformers' layout, whatever order interleaved pairs come out in)."""
        r = self.rope_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin, self.interleave), x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """The indexer keys of tokens ``x`` [B, T, H]: [B, T, d] (what the engine caches per token)."""
        with torch.no_grad():
            return self._rotate(self.k_norm(self.wk(x)).unsqueeze(2), cos, sin).squeeze(2)

    def select(self, x, q_low: torch.Tensor, cos, sin, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` [B, 1, T, S] (which keys each query may see) narrowed to each query's ``topk`` best-scored
        visible keys; ``q_low`` [B, T, q_lora_rank] the attention's normed low-rank query, ``keys`` [B, S, d]."""
        b, t, _ = x.shape
        with torch.no_grad():
            q = self._rotate(self.wq_b(q_low).view(b, t, self.heads, self.dim), cos, sin)
            scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1)) * self.scale)
            weights = self.weights_proj(x).float() * self.heads**-0.5  # [B, T, H]
            index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, T, S]
            # keys whose every head's score the ReLU zeroed tie at exactly 0, and topk breaks ties by its own
            # layout: the later key wins instead (2^-100 per position moves nothing else), so a query chooses the
            # same keys in a full forward, a packed row and the engine's paged steps
            index = index + torch.arange(index.shape[-1], device=index.device) * 2.0**-100
            index = index.masked_fill(~mask[:, 0], float("-inf"))
            k = min(self.topk, index.shape[-1])
            if k == index.shape[-1]:  # every key kept: nothing to narrow
                return mask
            chosen = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, index.topk(k, dim=-1).indices, True)
            return mask & chosen.unsqueeze(1)
