"""A Llama-style decoder, top to bottom (seed chapter 4): embedding -> n x [RMSNorm -> attention ->
residual -> RMSNorm -> SwiGLU MLP (or MoE) -> residual] -> RMSNorm -> LM head.

Shapes in comments: B batch, S sequence, D model dim, H query heads, K KV heads, d head size, V vocab.
Parameter names are Hugging Face Llama's, without the `model.` prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infra.config.model import ModelConfig

from .bf16_matmul import Linear
from .init import fill_initial, initial_std
from .kernels import rms_norm
from .moe import MLP, MoE
from .mtp import MTPModule, tokens_ahead


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls will run in: autocast's (bf16) when it is on, else x's own."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (as Hugging Face does).

    The result is returned in the dtype the next matmuls compute in: under bf16 autocast that is
    bf16, so q/k/v (or gate/up) share one cast instead of autocast casting the fp32 output once per
    projection (the same values either way)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, compute_dtype(x))  # kernels.py: the backward in closed form


def rope_cos_sin(positions: torch.Tensor, head_size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of RoPE angles in Hugging Face's layout: the frequencies are repeated, not interleaved
    ([f0..f_{d/2-1}, f0..f_{d/2-1}]), to go with `rotate_half`. positions [S] or [B, S] -> [.., S, d]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, device=positions.device, dtype=torch.float32) / head_size))
    angles = positions.float()[..., None] * inv_freq  # [.., S, d/2]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, d]; cos/sin [S, d] or [B, S, d] (cast to x's dtype, as Hugging Face does)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v; q [B, H, S, d], k/v [B, K, S, d] -> [B, H, S, d].
    enable_gqa shares each KV head with H/K consecutive query heads (HF's repeat_kv) without copying.
    `mask` [B, 1, S, S] (True = attend), when given, replaces the plain causal mask (document masking).

    On CPU, bf16/fp16 inputs are attended in fp32 and the result cast back: torch's CPU flash-attention
    kernel runs about 2x faster forward + backward in fp32 than in bf16 at the head sizes of small
    models (benchmarks/train_throughput.py), and fp32 is the more precise of the two. The casts touch
    only q, k, v and the output, a small fraction of the [B, H, S, S] work."""
    gqa = q.shape[1] != k.shape[1]
    causal = mask is None
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", enabled=False):  # autocast would cast the fp32 inputs back down
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal,
                                               enable_gqa=gqa)
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)


def document_positions_and_mask(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows of several documents, each token tagged with its document's id ([B, S], ids equal
    within a document and contiguous): RoPE positions that restart at 0 in every document, and the
    causal mask [B, 1, S, S] that lets a token attend only to earlier tokens of its own document. Without
    it, a packed SFT row's later conversations see the earlier ones (cross-contamination), which the
    model never sees at inference, where every prompt starts alone at position 0."""
    B, S = documents.shape
    idx = torch.arange(S, device=documents.device).expand(B, S)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values  # each token's document start
    same = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(S, S, dtype=torch.bool, device=documents.device).tril()
    return idx - first, (same & causal).unsqueeze(1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (K KV heads shared by H/K query heads each).

    `attention_fn` is the score-softmax-value step alone; code outside the model may replace it on an
    instance (context parallel swaps in ring or Ulysses attention) without touching the projections."""

    attention_fn = staticmethod(causal_attention)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_size = cfg.n_heads, cfg.kv_heads, cfg.head_size
        d = self.head_size
        self.q_proj = Linear(cfg.dim, self.n_heads * d)
        self.k_proj = Linear(cfg.dim, self.n_kv_heads * d)
        self.v_proj = Linear(cfg.dim, self.n_kv_heads * d)
        self.o_proj = Linear(self.n_heads * d, cfg.dim)
        # QK-norm (per head, as in OLMo 2 / Qwen 3): bounds attention logits, a loss-spike stabiliser.
        self.q_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, self.head_size)  # [B, S, H, d]
        k = self.k_proj(x).view(B, S, -1, self.head_size)  # [B, S, K, d]
        v = self.v_proj(x).view(B, S, -1, self.head_size)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, d]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if mask is None:
            y = self.attention_fn(q, k, v)
        elif self.attention_fn is causal_attention:
            y = causal_attention(q, k, v, mask)
        else:  # context parallel's ring/Ulysses attention shard the sequence; a full [S, S] mask does not fit them
            raise ValueError("document masking (packed post-training rows) is not supported with context parallel; "
                             "set parallel.cp=1 or the step's pack: false")
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))  # [B, S, D]


class Block(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h))."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        moe = cfg.moe
        if moe is not None and layer_id % moe.every == moe.every - 1:
            self.mlp: nn.Module = MoE(cfg.dim, moe.ffn_dim or cfg.ffn_dim, moe)
        else:
            self.mlp = MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # mask by keyword: tensor parallel's PrepareModuleInput plans the three positional inputs only
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask=mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """tokens [B, S] -> logits [B, S, V].

    `layers` is a ModuleDict keyed by the global layer index, so a pipeline stage can keep a subset
    (names stay `layers.7...`), and `embed_tokens` / `norm` / `lm_head` may be set to None on stages
    that do not hold them: then `forward` takes and returns hidden states [B, S, D].
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head: Linear | None = Linear(cfg.dim, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # multi-token prediction (mtp.py); None without it, so a D=0 model is exactly the plain one. Built
        # without touching torch's generator (init_weights draws its seed next): the trunk starts the same.
        self.mtp = None
        if cfg.mtp_depth:
            with torch.random.fork_rng(devices=[]):
                self.mtp = nn.ModuleList([MTPModule(cfg, k) for k in range(1, cfg.mtp_depth + 1)])
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, shard=None) -> None:
        """Every parameter's initial values as a pure function of (seed, its name, the position), drawn
        block by block (init.py: N(0, init_std) for matrices, 1/sqrt(2 n_layers) of it for o_proj and
        down_proj, ones for norm gains); buffers reset (MoE routing biases to zero).

        `seed` None draws one from torch's generator, so `torch.manual_seed` still decides. `shard(p)`,
        when given, returns (the tensor holding p's values here, its offset in p): code that holds a
        slice of a parameter fills just that slice with the whole model's values there. Parameters
        still on the meta device are left alone (nothing is allocated)."""
        if seed is None:  # drawn only for real tensors: a meta build leaves torch's generator alone
            real = any(not p.is_meta for p in self.parameters())
            seed = int(torch.randint(0, 2**62, (), device="cpu")) if real else 0
        for name, p in self.named_parameters():  # a tied weight once, under its first name
            local, offset = shard(p) if shard is not None else (p, None)
            if not local.is_meta:
                fill_initial(local, seed, name, p.shape, initial_std(self.cfg, name, p.dim()), offset)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Buffers' initial values (they are not random): the MoE routing biases start at zero. RoPE's
        angles are computed in forward, not kept."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.expert_bias.zero_()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, *, documents=None, head=None,
                mtp_heads=None):
        """`documents` [B, S], when given, tags each token with the packed document it belongs to: positions
        restart per document and attention stays inside it (see document_positions_and_mask).

        `head`, when given, is called as head(hidden, lm_head) in place of lm_head(hidden) and its
        result returned: a loss can then fuse the LM head with itself (trainer/loss.py HeadLoss) and
        never hold the full logits, while the head still runs inside this forward (where data- and
        tensor-parallel wrappers expect the model's parameters to be used).

        `mtp_heads` (with `head`, on a model with MTP modules): one head per depth k, called on depth k's
        normed hidden state (mtp.py); the forward then returns (head's result, [each depth's result])."""
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens  # [B, S, D]
        mask = None
        if documents is not None:
            positions, mask = document_positions_and_mask(documents.to(h.device))
        elif positions is None:
            positions = torch.arange(tokens.shape[1], device=h.device)  # h may be a sequence shard (SP)
        cos, sin = rope_cos_sin(positions, self.cfg.head_size, self.cfg.rope_theta)
        dtype = compute_dtype(h)
        cos, sin = cos.to(dtype), sin.to(dtype)  # once here rather than per layer and per q/k
        for layer in self.layers.values():
            h = layer(h, cos, sin) if mask is None else layer(h, cos, sin, mask)
        trunk = h  # h^0 of multi-token prediction: before the final norm
        if self.norm is not None:
            h = self.norm(h)
        if head is not None:
            if self.lm_head is None:
                raise ValueError("head= given to a model part without an LM head (a pipeline stage before the last)")
            if mtp_heads is not None:
                return head(h, self.lm_head), self.predict_ahead(tokens, trunk, cos, sin, mask, mtp_heads)
            return head(h, self.lm_head)
        if self.lm_head is not None:
            h = self.lm_head(h)  # [B, S, V]
        return h


    def predict_ahead(self, tokens, h, cos, sin, mask, heads) -> list:
        """The MTP depths in sequence (mtp.py): depth k combines h^{k-1} with the embedding of t_{i+k}."""
        if self.mtp is None or len(heads) != len(self.mtp):
            raise ValueError(f"{len(heads)} MTP heads for a model with mtp_depth={self.cfg.mtp_depth}")
        out = []
        for k, (module, head) in enumerate(zip(self.mtp, heads), start=1):
            h = module(h, self.embed_tokens(tokens_ahead(tokens, k)), cos, sin, mask)
            out.append(head(module.norm(h), self.lm_head))
        return out


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Total parameters, parameters active per token (top_k of E routed experts), the embedding's and the
    MTP modules' (included in total and active), counted on the meta device so nothing is allocated.
    Tied weights count once."""
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
    active = total
    for m in model.modules():
        if isinstance(m, MoE):
            routed = sum(p.numel() for p in m.experts.parameters())
            active -= routed - routed * m.top_k // m.num_experts
    embedding = model.embed_tokens.weight.numel()
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0  # shared embedding/head not again
    return {"total": total, "active": active, "embedding": embedding, "mtp": mtp}
