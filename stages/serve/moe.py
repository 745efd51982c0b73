"""The mixture-of-experts MLP at inference, as Hugging Face's Mixtral, Qwen2-MoE and Qwen3-MoE compute it
(the three architectures stages/export/hf.py writes; seed: "A mixture-of-experts (MoE) layer replaces the
single MLP with many MLPs ... plus a small router").

Routing: softmax over the router logits in float32, the top-k experts by probability, their weights
renormalised over the k chosen (always for Mixtral; `norm_topk_prob` for the Qwen ones). Mixtral keeps
the weights in float32 when it scales each expert's output; the Qwen ones cast them to the model dtype
first. No capacity limit: every token reaches its k experts (dropping is a training-time device).
Qwen2-MoE adds a shared expert gated per token by sigmoid(w . x).

Token-grouped, not dense: the T*k (token, expert) pairs are sorted by expert, each expert that received
tokens runs one SwiGLU over just its rows, and the results are index-added back in expert order (the
order HF adds them in, so the sums round alike). Experts are kept as per-expert weights (gate and up
fused), so INT4 expert weights (quant_linear.py) dequantize through `F.linear` as dense layers do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class MoEWeights:
    """One sparse layer's weights and routing rule."""

    router: torch.Tensor  # [E, H]
    gate_up: list  # per expert [2*I, H] (gate rows, then up rows)
    down: list  # per expert [H, I]
    top_k: int
    norm_topk_prob: bool  # renormalise the k chosen probabilities to sum to 1
    weights_in_fp32: bool  # Mixtral: scale expert outputs by float32 weights; Qwen: by model-dtype ones
    shared_gate_up: torch.Tensor | None = None  # Qwen2-MoE's always-on expert [2*Is, H]
    shared_down: torch.Tensor | None = None  # [H, Is]
    shared_gate: torch.Tensor | None = None  # [1, H]: its per-token sigmoid gate

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


def swiglu(h: torch.Tensor, gate_up, down) -> torch.Tensor:
    gu = F.linear(h, gate_up)
    inter = gu.shape[-1] // 2
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down)


def route(h: torch.Tensor, w: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, H] -> chosen experts [T, k] and their weights [T, k] (float32 or h's dtype, as the
    architecture does). Ties in topk break as torch's do in HF's own code: the same call."""
    logits = F.linear(h, w.router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, w.top_k, dim=-1)
    if w.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if not w.weights_in_fp32:
        top_w = top_w.to(logits.dtype)
    return top_i, top_w


def moe_mlp(h: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """The sparse MLP of normed hidden states h [T, H] -> [T, H] (the residual is added by the caller)."""
    T, k = h.shape[0], w.top_k
    top_i, top_w = route(h, w)
    flat = top_i.reshape(-1)  # pair p = token p // k, its (p % k)-th choice
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    pair_w = top_w.reshape(-1)[order]
    # one host sync per layer: the per-expert row counts decide which matmuls run
    counts = torch.bincount(flat, minlength=w.num_experts).tolist()
    out = torch.zeros_like(h)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = tokens[start:start + n]
        y = swiglu(h[idx], w.gate_up[e], w.down[e]) * pair_w[start:start + n, None]
        out.index_add_(0, idx, y.to(out.dtype))
        start += n
    if w.shared_gate_up is not None:
        shared = swiglu(h, w.shared_gate_up, w.shared_down)
        out = out + torch.sigmoid(F.linear(h, w.shared_gate)) * shared
    return out
