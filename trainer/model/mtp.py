"""Multi-token prediction (DeepSeek-V3, section 2.2): D sequential modules after the model, sharing its
embedding and LM head. Module k takes the previous depth's hidden state h^{k-1}_i (h^0: the last
block's output, before the final norm) and the embedding of token t_{i+k}:

    h'_i = eh_proj([hnorm(h^{k-1}_i); enorm(Emb(t_{i+k}))])      [B, S, 2D] -> [B, S, D]
    h^k_i = Block(h'_i)                                           one block of the model's own kind
    P^k_{i+k+1} = softmax(lm_head(norm(h^k_i)))                   predicts t_{i+k+1}

The sequence keeps its length S: the tokens are rolled left by k and the targets of the last k
positions are ignored by the loss, so causal attention, tensor/sequence-parallel layouts and shapes
are those of the main model. Parameter names: `mtp.{k-1}.{hnorm,enorm,eh_proj,block,norm}`.
"""

from __future__ import annotations

import torch
from torch import nn

from infra.config.model import ModelConfig

from .bf16_matmul import Linear


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, depth: int):
        from .transformer import Block, RMSNorm  # transformer.py builds these modules

        super().__init__()
        self.depth = depth
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim)
        # the last layer's kind (dense or MoE, by moe.every); its id beyond the trunk's
        self.block = Block(cfg, cfg.n_layers - 1)
        self.block.layer_id = cfg.n_layers + depth - 1
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, S, D] the previous depth's hidden, embedded [B, S, D] of the tokens k ahead -> h^k [B, S, D]."""
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(embedded)], dim=-1))
        return self.block(x, cos, sin) if mask is None else self.block(x, cos, sin, mask)


def tokens_ahead(tokens: torch.Tensor, k: int) -> torch.Tensor:
    """t_{i+k} at position i ([B, S]); the last k positions wrap around (their targets are ignored)."""
    return torch.roll(tokens, -k, dims=1)


def targets_ahead(targets: torch.Tensor, k: int, ignore_index: int) -> torch.Tensor:
    """Depth k's targets t_{i+k+1} = the next-token targets rolled left by k, the last k ignored."""
    out = torch.roll(targets, -k, dims=1)
    out[:, targets.shape[1] - k:] = ignore_index
    return out
