"""The serving model's one pass through its layers: embed, then per layer the token-wise math
(norms, projections, RoPE, MLP), the K/V writes and the attention over the step's groups
(attention.py), then the final norm and the LM head.

Every step runs `LayerPass.run`: model.forward calls it eagerly, and compiled_forward.py compiles
this same method whole for the steps it warms up. Weights come as plain tensors or as tensor-like
objects (quantized weights, LoRA-adapted projections, MoE experts), which only the eager pass sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, attend
from .moe import MoEWeights, moe_mlp


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)  # one fused op
    # same order of operations as HF LlamaRMSNorm: normalise in float32, then scale in the weight dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LayerPass:
    """The layers run eagerly (and the function compiled_forward.py compiles)."""

    compiled = False

    def __init__(self, shape):
        self.nh, self.kvh, self.d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.eps = shape.rms_norm_eps
        self.inter = shape.intermediate_size

    @property
    def eager(self) -> "LayerPass":
        return self

    def covers(self, meta: AttentionMetadata, cache, logits_rows) -> bool:
        """Whether the step runs compiled: never, here."""
        return False

    def run(self, ids: torch.Tensor, embed, cos: torch.Tensor, sin: torch.Tensor, weights: list[tuple[tuple, tuple]],
            final_norm, lm_head, cache, meta: AttentionMetadata, logits_rows: torch.Tensor | None,
            hidden_out: torch.Tensor | None = None) -> torch.Tensor:
        """ids [T] -> float32 logits of `logits_rows` (None: every row). `weights`: per layer the two
        tuples of PagedLlama.layer_weights; `cos`/`sin`: [T, 1, d] RoPE rows of the tokens' positions;
        `cache`: model.KVCacheTensors. `hidden_out` [slots, H]: when given, every row's last-layer output
        (before the final norm) is written at its KV slot (what MTP drafting reads: mtp_proposer.py)."""
        x = embed[ids]
        for li, (w_in, w_out) in enumerate(weights):
            q, kv_new = self.attn_in(x, w_in, cos, sin)
            # write first, then read: every sequence sees this step's K/V of its own earlier tokens
            cache.write_stacked(li, meta.slot_mapping, kv_new)
            if meta.slot_write is not None:
                meta.slot_write.write(li, kv_new)
            x = self.attn_out(x, attend(li, q, kv_new, meta.groups, cache), w_out)
        if hidden_out is not None:
            hidden_out[meta.slot_mapping] = x
        return self.head(x if logits_rows is None else x[logits_rows], final_norm, lm_head)

    def attn_in(self, x: torch.Tensor, w: tuple, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> q [T, heads, d] with RoPE, and K/V stacked as [2, kv_heads, T, d]."""
        attn_norm, qkv_w, qkv_b, q_norm, k_norm = w
        nh, kvh, d, T = self.nh, self.kvh, self.d, x.shape[0]
        h = _rms_norm(x, attn_norm, self.eps)
        qkv = F.linear(h, qkv_w, qkv_b)
        v = qkv[:, (nh + kvh) * d:].view(T, kvh, d)
        if q_norm is None:  # RoPE on queries and keys together: one set of ops, not two (sin: sign-folded)
            qk = qkv[:, : (nh + kvh) * d].view(T, nh + kvh, d)
            qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin
            q, k = qk[:, :nh], qk[:, nh:]
        else:
            q = _rms_norm(qkv[:, : nh * d].view(T, nh, d), q_norm, self.eps)
            k = _rms_norm(qkv[:, nh * d: (nh + kvh) * d].view(T, kvh, d), k_norm, self.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        return q, torch.stack((k, v)).transpose(1, 2)

    def attn_out(self, x: torch.Tensor, attn: torch.Tensor, w: tuple) -> torch.Tensor:
        """The residual stream after the output projection and the MLP."""
        o, mlp_norm, gate_up, down = w
        T = x.shape[0]
        x = x + F.linear(attn.reshape(T, self.nh * self.d), o)
        h = _rms_norm(x, mlp_norm, self.eps)
        if isinstance(gate_up, MoEWeights):  # a sparse layer (moe.py): `down` is None
            return x + moe_mlp(h, gate_up)
        gu = F.linear(h, gate_up)
        return x + F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter:], down)

    def head(self, x, final_norm, lm_head):
        """Logits (float32) of the rows given."""
        return F.linear(_rms_norm(x, final_norm, self.eps), lm_head).float()
