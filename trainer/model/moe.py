"""The feed-forward layers: the SwiGLU MLP and a mixture of experts made of them (seed: "A
mixture-of-experts (MoE) layer replaces the single MLP with many MLPs ... plus a small router").

Names follow Hugging Face's Qwen2-MoE: `mlp.gate` (router), `mlp.experts.{e}.{gate,up,down}_proj`,
`mlp.shared_expert.*`. Shapes: T tokens (B*S flattened), D model dim, E experts, k = top_k.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from infra.config.model import MoEConfig

from .bf16_matmul import Linear


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routing over E SwiGLU experts, with optional capacity (overflow dropped) and balancing.

    After each forward the layer keeps, for the trainer to read:
      aux_loss       Switch/GShard load-balancing loss E * sum_e f_e * P_e (unscaled), or None
      tokens_per_expert  [E] routed assignments per expert before dropping (detached)
      dropped_fraction   share of the T*k assignments dropped by the capacity limit
    A token whose every assignment was dropped gets zero from this layer: the block's residual
    carries it through unchanged (seed: "they skip the MLP and pass through the residual path").
    """

    def __init__(self, dim: int, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.pad_to_capacity = cfg.pad_to_capacity  # read by expert parallel's dispatch only
        self.balance = cfg.balance
        self.aux_loss_coef = cfg.aux_loss_coef
        self.bias_update_rate = cfg.bias_update_rate
        self.gate = Linear(dim, cfg.num_experts)
        self.experts = nn.ModuleList(MLP(dim, hidden) for _ in range(cfg.num_experts))
        self.shared_expert = MLP(dim, hidden) if cfg.shared_expert else None
        # DeepSeek-V3's per-expert routing bias: it shifts which experts are chosen, not their weights,
        # and is moved by the sign of the load error outside the gradient (`update_bias`).
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped_fraction: torch.Tensor | None = None

    def capacity(self, num_tokens: int) -> int | None:
        """Slots per expert: ceil(factor * T * k / E) (Switch Transformer); None = unlimited."""
        if self.capacity_factor is None:
            return None
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> router probabilities [T, E], chosen experts [T, k], their weights [T, k]."""
        probs = self.gate(x).float().softmax(dim=-1)
        scores = probs + self.expert_bias if self.balance == "bias" else probs
        experts = scores.topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        weights = weights / weights.sum(dim=-1, keepdim=True)  # renormalised over the k chosen (Mixtral)
        return probs, experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        T, E, k = x.shape[0], self.num_experts, self.top_k
        probs, experts, weights = self.route(x)
        # Assignments in priority order: every token's first choice before any second choice (GShard),
        # so under capacity pressure a token loses its weaker expert first.
        expert_of = experts.t().reshape(-1)  # [k*T]
        token_of = torch.arange(T, device=x.device).repeat(k)
        weight_of = weights.t().reshape(-1)
        one_hot = F.one_hot(expert_of, E)  # [k*T, E]
        slot = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # position in its expert's queue
        cap = self.capacity(T)
        keep = slot < cap if cap is not None else torch.ones_like(slot, dtype=torch.bool)

        out = torch.zeros_like(x, dtype=torch.float32)  # combine in fp32 even when experts run in bf16
        order = torch.argsort(expert_of[keep], stable=True)
        kept_tokens, kept_weights = token_of[keep][order], weight_of[keep][order]
        counts = torch.bincount(expert_of[keep], minlength=E).tolist()
        start = 0
        for e, n in enumerate(counts):
            # Every expert runs, even on zero tokens, so all parameters join the graph (DDP needs that).
            tokens = kept_tokens[start : start + n]
            y = self.experts[e](x[tokens]) * kept_weights[start : start + n, None].to(x.dtype)
            out.index_add_(0, tokens, y.to(out.dtype))
            start += n
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)

        self.record_routing(one_hot, keep, probs)
        return out.view(shape)

    def record_routing(self, one_hot: torch.Tensor, keep: torch.Tensor, probs: torch.Tensor) -> None:
        """Load statistics and the auxiliary balancing loss of one routing ([T*k, E] one-hot assignments,
        [T*k] kept mask, [T, E] router probabilities); shared by the expert-parallel forward."""
        T, E = probs.shape
        k = one_hot.shape[0] // T
        load = one_hot.sum(dim=0)  # [E] assignments before dropping
        self.tokens_per_expert = load.detach()
        self.dropped_fraction = (1.0 - keep.float().mean()).detach()
        if self.balance == "aux_loss":
            # f_e: share of assignments sent to e; P_e: mean router probability of e (Switch eq. 4).
            f = load.float() / (T * k)
            self.aux_loss = E * (f * probs.mean(dim=0)).sum()
        else:
            self.aux_loss = None

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3: b_e += gamma * sign(mean load - load_e): under-used experts become likelier."""
        load = tokens_per_expert.float().to(self.expert_bias.device)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)


def imbalance(tokens_per_expert: torch.Tensor) -> float:
    """max load / mean load: 1.0 is perfectly balanced, E means one expert takes everything."""
    load = tokens_per_expert.float()
    return float(load.max() / load.mean().clamp_min(1e-9))
