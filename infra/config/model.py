"""`model:` the transformer's shape (Llama-style, optional mixture of experts)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section


class MoEConfig(Section):
    """Mixture of experts replacing the dense MLP (seed: 8 experts, top-2 -> ~6.0B total, 1.95B active)."""

    num_experts: int = Field(8, ge=1, description="routed experts per MoE layer")
    top_k: int = Field(2, ge=1, description="experts each token is sent to")
    ffn_dim: int | None = Field(None, ge=1, description="hidden width of one expert; default model.ffn_dim")
    shared_expert: bool = Field(False, description="one always-on expert beside the routed ones (DeepSeek-V3)")
    capacity_factor: float | None = Field(
        None, gt=0, description="slots per expert = factor * tokens * top_k / E; overflow is dropped; None = no dropping"
    )
    pad_to_capacity: bool = Field(
        False, description="expert parallel: every expert's capacity of slots is sent, zeros where fewer tokens "
        "were routed to it, so the dispatch/combine all-to-all has a fixed size whatever the routing, and no counts "
        "are exchanged first (Megatron's --moe-pad-expert-input-to-capacity, GShard); needs capacity_factor"
    )
    balance: Literal["aux_loss", "bias", "none"] = Field(
        "aux_loss", description="aux_loss (Switch/GShard) or bias (DeepSeek-V3 aux-loss-free balancing)"
    )
    aux_loss_coef: float = Field(0.01, ge=0)
    bias_update_rate: float = Field(1e-3, ge=0, description="DeepSeek-V3's gamma for the per-expert routing bias")
    every: int = Field(1, ge=1, description="every n-th layer is MoE (1 = all)")

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoEConfig":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        return self

    @model_validator(mode="after")
    def _padding_has_a_capacity(self) -> "MoEConfig":
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("model.moe.pad_to_capacity=true with capacity_factor=None: padding fills each expert "
                             "to its capacity, which capacity_factor sets; set capacity_factor (e.g. 1.25) or "
                             "pad_to_capacity=false")
        return self


class ModelConfig(Section):
    """Decoder-only transformer: RMSNorm, RoPE, GQA attention, SwiGLU MLP (seed chapter 4)."""

    vocab_size: int = Field(32000, ge=2)
    dim: int = Field(4096, ge=1, description="hidden size h")
    n_layers: int = Field(5, ge=1)
    n_heads: int = Field(32, ge=1)
    n_kv_heads: int | None = Field(None, ge=1, description="grouped-query KV heads; default n_heads")
    head_dim: int | None = Field(None, ge=1, description="default dim / n_heads")
    ffn_dim: int = Field(11008, ge=1, description="SwiGLU hidden width")
    max_seq_len: int = Field(2048, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = False
    qk_norm: bool = Field(False, description="RMSNorm on queries and keys per head (a loss-spike stabiliser)")
    z_loss: float = Field(0.0, ge=0, description="coefficient of the z-loss log(Z)^2 on the logits")
    init_std: float = Field(0.02, gt=0)
    moe: MoEConfig | None = None
    mtp_depth: int = Field(0, ge=0, le=8, description="multi-token prediction (DeepSeek-V3 sec. 2.2): D sequential "
                           "modules after the model, module k predicting token i+k+1; 0 = none")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @model_validator(mode="after")
    def _shapes(self) -> "ModelConfig":
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}")
        if self.head_size % 2:
            raise ValueError(f"head size {self.head_size} must be even for RoPE")
        return self
