"""A Llama forward over a flat batch of tokens that reads and writes a paged KV cache.

The weights come straight from a Hugging Face checkpoint folder (config.json + safetensors with
the HF names: what the export stage writes and what vLLM loads). Every token of the step (prefill
chunks, decodes, draft tokens to verify) goes through each matmul together; only attention is
per sequence: each layer first writes the step's K/V into their cache slots, then every sequence
attends over the K/V gathered from its block table (PagedAttention's indirection, done with a
gather and SDPA, which runs on CPU and CUDA alike), or read in place from its decode slot.
`forward` prepares a step (RoPE rows, each layer's weights) and hands it to the one pass through
the layers (layer_pass.py; attention over the step's groups in attention.py), eager or compiled
(compiled_forward.py).

Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE: what the export stage writes) load
too: their sparse layers' MLP is moe.py's token-grouped expert computation, the rest is unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import AttentionGroup, AttentionMetadata, build_attention_metadata  # noqa: F401 - re-exported
from .gguf_loader import find_gguf, load_gguf
from .layer_pass import LayerPass
from .lora import LoRAAdapter, LoRAStep
from .moe import MoEWeights
from .quant_linear import take_quantized

FP8_MAX = 448.0  # largest finite float8 e4m3 value


@dataclass
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    # mixture of experts (moe.py), as the architecture's own config.json says; num_experts 0 = dense
    moe_arch: str | None = None  # mixtral, qwen2_moe or qwen3_moe
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one routed expert's hidden width
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's gated shared expert; 0 = none
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the MoE; the others are dense
    norm_topk_prob: bool = True  # the k chosen weights renormalised to sum to 1

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LlamaShape":
        arch = cfg.get("architectures") or ["LlamaForCausalLM"]
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3", *MOE_ARCHS) or \
                not any(a.endswith("ForCausalLM") for a in arch):
            raise ValueError(f"unsupported checkpoint: model_type={model_type!r} architectures={arch}")
        if model_type not in MOE_ARCHS and (cfg.get("num_local_experts") or cfg.get("num_experts")):
            raise ValueError(f"mixture-of-experts checkpoint with model_type={model_type!r}: this engine serves "
                             f"MoE as {', '.join(MOE_ARCHS)} only")
        rope = dict(cfg.get("rope_parameters") or {})  # transformers 5
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            **(moe_fields(cfg) if model_type in MOE_ARCHS else {}),
        )


MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_fields(cfg: dict) -> dict:
    """LlamaShape's expert fields from a Mixtral / Qwen2-MoE / Qwen3-MoE config.json, with each
    architecture's own defaults for keys left out (transformers' configuration_*.py) and its own rule
    for which layers are sparse (modeling_*.py's decoder layer)."""
    kind, n_layers = cfg["model_type"], cfg["num_hidden_layers"]
    max_pos = cfg.get("max_position_embeddings", 2048)
    if kind == "mixtral":
        window = cfg.get("sliding_window")
        if window is not None and window < max_pos:
            raise ValueError(f"Mixtral checkpoint with sliding_window={window} < max_position_embeddings={max_pos}: "
                             "sliding-window attention is not supported by this engine")
        num_experts, top_k = int(cfg.get("num_local_experts", 8)), int(cfg.get("num_experts_per_tok", 2))
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"mixtral checkpoint with num_experts_per_tok={top_k} and num_local_experts={num_experts}")
        return dict(moe_arch=kind, num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(cfg["intermediate_size"]), sparse_layers=tuple(range(n_layers)),
                    norm_topk_prob=True)  # Mixtral always renormalises
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{kind} checkpoint with use_sliding_window=true: sliding-window attention is not "
                         "supported by this engine")
    defaults = {"qwen2_moe": (60, 4, 1408), "qwen3_moe": (128, 8, 768)}[kind]
    num_experts = int(cfg.get("num_experts", defaults[0]))
    step = int(cfg.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"{kind} checkpoint with decoder_sparse_step={step}: must be >= 1")
    dense_only = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(n_layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0)
    shared = int(cfg.get("shared_expert_intermediate_size", 5632)) if kind == "qwen2_moe" else 0
    top_k = int(cfg.get("num_experts_per_tok", defaults[1]))
    if sparse and not 1 <= top_k <= num_experts:
        raise ValueError(f"{kind} checkpoint with num_experts_per_tok={top_k} and num_experts={num_experts}")
    return dict(moe_arch=kind, num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", defaults[2])),
                shared_expert_intermediate_size=shared, sparse_layers=sparse,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def load_moe(s: LlamaShape, prefix: str, get) -> MoEWeights:
    """One sparse layer's weights under the architecture's on-disk names (what stages/export/hf.py
    writes and transformers reads): Mixtral's `block_sparse_moe.gate` and `experts.{e}.w1/w3/w2`
    (gate/up/down), the Qwen ones' `mlp.gate` and `experts.{e}.{gate,up,down}_proj`, plus Qwen2-MoE's
    `shared_expert.*` and `shared_expert_gate`."""
    H, E, Ie = s.hidden_size, s.num_experts, s.moe_intermediate_size
    if s.moe_arch == "mixtral":
        base, names = prefix + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        base, names = prefix + "mlp.", ("gate_proj", "up_proj", "down_proj")
    gate_up, down = [], []
    for e in range(E):
        g, u, d = (f"{base}experts.{e}.{n}.weight" for n in names)
        gate_up.append(torch.cat([get(g, (Ie, H)), get(u, (Ie, H))]).contiguous())
        down.append(get(d, (H, Ie)))
    w = MoEWeights(router=get(base + "gate.weight", (E, H)), gate_up=gate_up, down=down,
                   top_k=s.num_experts_per_tok, norm_topk_prob=s.norm_topk_prob,
                   weights_in_fp32=s.moe_arch == "mixtral")
    Is = s.shared_expert_intermediate_size
    if Is > 0:
        w.shared_gate_up = torch.cat([get(base + "shared_expert.gate_proj.weight", (Is, H)),
                                      get(base + "shared_expert.up_proj.weight", (Is, H))]).contiguous()
        w.shared_down = get(base + "shared_expert.down_proj.weight", (H, Is))
        w.shared_gate = get(base + "shared_expert_gate.weight", (1, H))
    if any(t is not None and not isinstance(t, torch.Tensor) for t in (w.router, w.shared_gate)):
        raise ValueError(f"{base}gate / shared_expert_gate are quantized: MoE routers must stay unquantized "
                         "(the export stage keeps them in the export dtype)")
    return w


def rope_inv_freq(shape: LlamaShape) -> torch.Tensor:
    d = shape.head_dim
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = shape.rope_scaling
    if not s:
        return inv
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":  # Llama 3.1's frequency-dependent scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


class KVCacheTensors:
    """K and V of every layer in one tensor per layer, [2, kv_heads, num_blocks * block_size, head_dim],
    in the model's dtype or in float8 e4m3 with a float32 scale per (K/V, head, slot): an FP8 cache
    halves the cache (seed, export chapter).

    Heads sit outside the blocks so that gathering a batch's block tables gives K and V already laid
    out as [kv_heads, S, context, head_dim], contiguous: attention reads them without another copy."""

    def __init__(self, shape: LlamaShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, fp8: bool = False):
        self.fp8 = fp8
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.compute_dtype = dtype
        store = torch.float8_e4m3fn if fp8 else dtype
        kv_shape = (2, shape.num_kv_heads, num_blocks * block_size, shape.head_dim)
        self.kv = [torch.zeros(kv_shape, dtype=store, device=device) for _ in range(shape.num_layers)]
        if fp8:
            sc = (2, shape.num_kv_heads, num_blocks * block_size, 1)
            self.scale = [torch.ones(sc, device=device) for _ in range(shape.num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] into their slots."""
        self.write_stacked(layer, slots, torch.stack((k, v)).transpose(1, 2))

    def write_stacked(self, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """x: K and V stacked as [2, kv_heads, T, head_dim] into their slots."""
        if self.fp8:
            scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
            self.scale[layer][:, :, slots] = scale
            self.kv[layer][:, :, slots] = (x.float() / scale).to(torch.float8_e4m3fn)
        else:
            self.kv[layer][:, :, slots] = x

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[S, Bmax] block ids -> K, V as [kv_heads, S, Bmax*block_size, head_dim], contiguous."""
        S, B = block_tables.shape
        cache = self.kv[layer]
        two, kvh, _, d = cache.shape
        flat = block_tables.reshape(-1)
        # index_select over whole blocks (block_size*d contiguous values each): about twice as fast
        # on CPU as the equivalent advanced indexing
        x = cache.view(two * kvh, self.num_blocks, self.block_size * d).index_select(1, flat)
        if self.fp8:
            sc = self.scale[layer].view(two * kvh, self.num_blocks, self.block_size).index_select(1, flat)
            x = (x.view(two * kvh, S * B, self.block_size, d).to(self.compute_dtype)
                 * sc.unsqueeze(-1).to(self.compute_dtype))
        x = x.view(two, kvh, S, B * self.block_size, d)
        return x[0], x[1]


def load_hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def dequantize_state_dict(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """FP8 (e4m3) weights with a per-channel `<name>_scale` (the export stage's FP8 variant) become
    `dtype` weights; everything else is cast. The engine computes in `dtype` either way."""
    out = {}
    for name, t in sd.items():
        if name.endswith("_scale") and name[: -len("_scale")] in sd:
            continue
        scale = sd.get(name + "_scale")
        if scale is None and name.endswith(".weight"):
            scale = sd.get(name[: -len(".weight")] + ".weight_scale")
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or scale is not None:
            w = t.float()
            if scale is not None:
                s = scale.float()
                w = w * (s.view(-1, *([1] * (w.dim() - 1))) if s.dim() == 1 else s)
            out[name] = w.to(dtype)
        elif t.is_floating_point():
            out[name] = t.to(dtype)
        else:
            out[name] = t
    return out


class PagedLlama:
    """Weights as plain tensors (q/k/v and gate/up fused so each is one matmul) and a forward."""

    # [slots, H]: set by MTP drafting (mtp_proposer.py) to receive every row's last hidden state per KV slot
    hidden_cache: torch.Tensor | None = None

    def __init__(self, shape: LlamaShape, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, quantization_config: dict | None = None):
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.quantization_config = quantization_config  # config.json's (compressed-tensors), if any
        self.load_weights(state_dict)
        # how the layers run: LayerPass eagerly; compile() swaps in compiled_forward.CompiledLayerPass
        self.pieces: LayerPass = LayerPass(shape)
        inv = rope_inv_freq(shape)
        pos = torch.arange(shape.max_position_embeddings, dtype=torch.float64)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)
        # rotate_half(x) * sin == roll(x, d/2) * [-sin | sin]: one roll instead of two slices, a neg and a cat
        half = shape.head_dim // 2
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "PagedLlama":
        model_dir = Path(model_dir)
        cfg_path = model_dir / "config.json"
        gguf_file = None if cfg_path.exists() else find_gguf(model_dir)
        if gguf_file is not None:  # a llama.cpp file: shape from its metadata, Q8_0/Q4_0 kept in blocks
            conf, sd = load_gguf(gguf_file, dtype)
            return cls(LlamaShape.from_hf_config(conf), sd, dtype, torch.device(device))
        if not cfg_path.exists():
            raise FileNotFoundError(f"{model_dir} is not a Hugging Face checkpoint folder (no config.json)")
        conf = json.loads(cfg_path.read_text())
        return cls(LlamaShape.from_hf_config(conf), load_hf_state_dict(model_dir), dtype, torch.device(device),
                   conf.get("quantization_config"))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """(Re)load weights with HF names; missing or misshapen tensors fail naming the tensor."""
        s = self.shape
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
        # INT4 packs, int8 (W8A8) channels and GGUF blocks stay quantized (quant_linear.py)
        quantized = take_quantized(sd, self.dtype, self.quantization_config)
        sd = dequantize_state_dict(sd, self.dtype)
        sd.update(quantized)

        def get(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            if name in quantized and (shape is None or tuple(quantized[name].shape) == shape):
                return quantized[name].to(device=self.device)
            if name not in sd:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            t = sd[name]
            if shape is not None and tuple(t.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
            return t.to(device=self.device, dtype=self.dtype).contiguous()

        H, d, kvh = s.hidden_size, s.head_dim, s.num_kv_heads
        self.embed = get("model.embed_tokens.weight", (s.vocab_size, H))
        self.lm_head = self.embed if s.tie_word_embeddings or "lm_head.weight" not in sd else \
            get("lm_head.weight", (s.vocab_size, H))
        self.final_norm = get("model.norm.weight", (H,))
        self.layers = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            q = get(p + "self_attn.q_proj.weight", (s.num_heads * d, H))
            k = get(p + "self_attn.k_proj.weight", (kvh * d, H))
            v = get(p + "self_attn.v_proj.weight", (kvh * d, H))
            bias = None
            if p + "self_attn.q_proj.bias" in sd:
                bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            layer = {
                "attn_norm": get(p + "input_layernorm.weight", (H,)),
                "qkv": torch.cat([q, k, v]).contiguous(),
                "qkv_bias": bias,
                "o": get(p + "self_attn.o_proj.weight", (H, s.num_heads * d)),
                "mlp_norm": get(p + "post_attention_layernorm.weight", (H,)),
                "moe": load_moe(s, p, get) if s.is_sparse(i) else None,
                "q_norm": get(p + "self_attn.q_norm.weight") if p + "self_attn.q_norm.weight" in sd else None,
                "k_norm": get(p + "self_attn.k_norm.weight") if p + "self_attn.k_norm.weight" in sd else None,
            }
            if layer["moe"] is None:
                layer["gate_up"] = torch.cat([get(p + "mlp.gate_proj.weight", (s.intermediate_size, H)),
                                              get(p + "mlp.up_proj.weight", (s.intermediate_size, H))]).contiguous()
                layer["down"] = get(p + "mlp.down_proj.weight", (H, s.intermediate_size))
            self.layers.append(layer)

    def weight_views(self) -> dict[str, torch.Tensor] | None:
        """Each Hugging Face tensor name -> the view of the engine's own tensor that holds it (q/k/v rows of
        the fused qkv, gate/up rows of gate_up), so new values can be copied in place; None when some
        weights are not plain dense tensors (MoE experts, quantized layers), which load_weights rebuilds."""
        s = self.shape
        if self.quantization_config or any(layer["moe"] is not None for layer in self.layers):
            return None
        H, d, kvh = s.hidden_size, s.head_dim, s.num_kv_heads
        q, kv = s.num_heads * d, kvh * d
        views = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        if self.lm_head is not self.embed:
            views["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qkv, gate_up = layer["qkv"], layer["gate_up"]
            views.update({p + "self_attn.q_proj.weight": qkv[:q], p + "self_attn.k_proj.weight": qkv[q:q + kv],
                          p + "self_attn.v_proj.weight": qkv[q + kv:], p + "self_attn.o_proj.weight": layer["o"],
                          p + "input_layernorm.weight": layer["attn_norm"],
                          p + "post_attention_layernorm.weight": layer["mlp_norm"],
                          p + "mlp.gate_proj.weight": gate_up[:s.intermediate_size],
                          p + "mlp.up_proj.weight": gate_up[s.intermediate_size:], p + "mlp.down_proj.weight": layer["down"]})
            if layer["qkv_bias"] is not None:
                b = layer["qkv_bias"]
                views.update({p + "self_attn.q_proj.bias": b[:q], p + "self_attn.k_proj.bias": b[q:q + kv],
                              p + "self_attn.v_proj.bias": b[q + kv:]})
            for n in ("q_norm", "k_norm"):
                if layer[n] is not None:
                    views[p + f"self_attn.{n}.weight"] = layer[n]
        return views

    def copy_weights(self, sd: dict[str, torch.Tensor]) -> bool:
        """Copy the given tensors (Hugging Face names; any subset) into the engine's own in place: nothing is
        reallocated, so compiled steps and captured graphs keep their addresses. False (nothing copied) when
        the engine cannot (weight_views is None); an unknown name or a wrong shape fails naming the tensor."""
        views = self.weight_views()
        if views is None:
            return False
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
        for name, t in sd.items():
            if name not in views:
                raise KeyError(f"the engine holds no tensor {name!r}")
            if tuple(t.shape) != tuple(views[name].shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(views[name].shape)}")
        with torch.no_grad():
            for name, t in sd.items():
                views[name].copy_(t)
        return True

    def layer_weights(self, li: int, lora: LoRAStep | None = None) -> tuple[tuple, tuple]:
        """Layer `li`'s weights as the two tuples the pieces take: (attention in, attention out + MLP).
        With `lora`, the projections this step's adapters adapt come as LoRALinear (lora.py)."""
        L = self.layers[li]
        if lora is not None:
            L = {**L, **{p: lora.wrap(li, p, L[p]) for p in ("qkv", "o", "gate_up", "down") if p in L}}
        return ((L["attn_norm"], L["qkv"], L["qkv_bias"], L["q_norm"], L["k_norm"]),
                (L["o"], L["mlp_norm"], L["gate_up"], L["down"]) if L["moe"] is None else
                (L["o"], L["mlp_norm"], L["moe"], None))

    def compile(self) -> bool:
        """Run all-decode steps compiled (compiled_forward.py; warmed up by the engine, which owns
        the caches); False, with a logged warning, when the model cannot be and stays eager."""
        from .compiled_forward import CompiledLayerPass

        pieces = CompiledLayerPass.build(self)
        if pieces is not None:
            self.pieces = pieces
        return pieces is not None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        cache: KVCacheTensors,
        logits_index: torch.Tensor | None,  # [N] rows whose logits are wanted (None: every row)
        lora: LoRAStep | None = None,  # the rows that use LoRA adapters (lora.py); None: base model only
    ) -> torch.Tensor:
        # RoPE as q*cos + rotate_half(q)*sin (q/k-norm models) or q*cos + roll(q)*sin_signed
        cos = self.cos[meta.positions][:, None, :]  # [T, 1, d]
        sin = (self.sin if self.layers[0]["q_norm"] is not None else self.sin_signed)[meta.positions][:, None, :]
        weights = [self.layer_weights(li, lora) for li in range(len(self.layers))]
        pieces = self.pieces
        # adapter rows run eagerly, through the adapted weights; so does any step not warmed up
        if lora is not None or not pieces.covers(meta, cache, logits_index):
            pieces = pieces.eager
        # with MTP drafting, every step also writes the hidden states the drafts read (mtp_proposer.py)
        return pieces.run(input_ids, self.embed, cos, sin, weights, self.final_norm, self.lm_head, cache, meta,
                          logits_index, hidden_out=self.hidden_cache)


def run_paged(
    model: PagedLlama,
    cache: KVCacheTensors,
    seqs: list[tuple[list[int], int, list[int]]],
    rows: list[list[int]],
    short_query: int = 16,
    adapters: list[LoRAAdapter | None] | None = None,
) -> torch.Tensor:
    """One forward over several sequences. `seqs`: (block ids, start position, new token ids);
    `rows[i]`: which of sequence i's new tokens (0-based) want logits; `adapters[i]`: the LoRA
    adapter sequence i runs with (None, or no list: the base model). Returns [sum(rows), V] in the
    order of `seqs` and `rows`.

    Internally the flat batch is ordered as the attention groups are (short queries by context
    length first), so that each group's query rows are one contiguous slice."""
    key = lambda i: (len(seqs[i][2]) > short_query, seqs[i][1] + len(seqs[i][2]))  # noqa: E731
    order = sorted(range(len(seqs)), key=key)
    base = [0] * len(seqs)
    ids: list[int] = []
    for i in order:
        base[i] = len(ids)
        ids.extend(seqs[i][2])
    index = [base[i] + r for i in range(len(seqs)) for r in rows[i]]
    dev = model.device
    meta = build_attention_metadata([(seqs[i][0], seqs[i][1], len(seqs[i][2])) for i in order], cache.block_size,
                                    dev, query_group=model.shape.num_heads // model.shape.num_kv_heads,
                                    short_query=short_query)
    return model.forward(
        torch.tensor(ids, dtype=torch.long, device=dev),
        meta,
        cache,
        torch.tensor(index, dtype=torch.long, device=dev),
        None if adapters is None else LoRAStep.from_runs(((adapters[i], len(seqs[i][2])) for i in order), dev),
    )
