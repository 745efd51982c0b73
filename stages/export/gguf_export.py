"""GGUF for llama.cpp, written with the `gguf` package: F16 / BF16 / Q8_0 / Q4_0 weights with llama.*
metadata (context, widths, head counts, RoPE base, RMSNorm eps) and the tokenizer as GPT-2-style BPE
metadata (tokens, types, merges, special ids, the end-of-turn id and the chat template, so llama.cpp's
chat endpoints render turns and stop at their end).

RoPE layout: llama.cpp's `llama` architecture rotates adjacent pairs (x[2i], x[2i+1]) (Meta's layout),
while Hugging Face (and our model) rotates the two halves (x[i], x[i + d/2]). The same model in both
conventions differs by a fixed permutation of the q and k rows of every head, which llama.cpp's own
converter applies; `permute_rope_rows` is that permutation and `unpermute_rope_rows` its inverse. This is
the "wrong RoPE setting" the seed warns about: without it the file loads and produces garbage.

MoE (Mixtral form): the router is `ffn_gate_inp` (kept F32, as llama.cpp does), and each projection's
experts are stacked into one 3-D tensor `ffn_{gate,up,down}_exps` [E, out, in]; llama.cpp routes as we do
at inference (softmax, top-k, weights renormalised, no capacity).

Block formats (ggml): Q8_0 stores 32 weights as one fp16 scale + 32 int8; Q4_0 one fp16 scale + 32
4-bit values. The token embedding and output matrix of the Q4_0 file are Q8_0, as llama.cpp's own
quantizer keeps the output at higher precision. 1-D tensors (norms) are F32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infra.config.model import ModelConfig

GGUF_VARIANTS = ("gguf-f16", "gguf-bf16", "gguf-q8_0", "gguf-q4_0")


class GGUFUnsupported(ValueError):
    """The model has a feature this writer does not map to llama.cpp (the message says which)."""


def permute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Half-split (HF) -> interleaved (llama.cpp) rows of q_proj / k_proj: [heads*d, in]."""
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# our name -> llama.cpp name (gguf.TENSOR_NAMES for MODEL_ARCH.LLAMA); experts.* are stacked tensors
_LAYER_NAMES = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}


def _gguf_tensors(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict with each layer's experts stacked: `layers.{i}.mlp.experts.{proj}.weight` [E, out, in]."""
    import re

    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in sd.items():
        if name.endswith("expert_bias"):
            if torch.count_nonzero(t):
                raise GGUFUnsupported(f"{name} is non-zero: llama.cpp's router has no selection bias")
            continue
        m = re.match(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+_proj\.weight)$", name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def gguf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    return f"blk.{parts[1]}.{_LAYER_NAMES[parts[2]]}"


def our_name(name: str) -> str:
    inv_top = {v: k for k, v in _TOP_NAMES.items()}
    if name in inv_top:
        return inv_top[name]
    inv = {v: k for k, v in _LAYER_NAMES.items()}
    _, layer, rest = name.split(".", 2)
    return f"layers.{layer}.{inv[rest]}"


def check_supported(cfg: ModelConfig) -> None:
    moe = cfg.moe
    if moe is not None and (moe.every != 1 or moe.shared_expert):
        raise GGUFUnsupported(f"GGUF export writes MoE in llama.cpp's Mixtral form (every layer MoE, no shared "
                              f"expert); this MoE has every={moe.every}, shared_expert={moe.shared_expert}")
    if cfg.qk_norm:
        raise GGUFUnsupported("GGUF export uses llama.cpp's `llama` architecture, which has no QK-norm")


def tokenizer_metadata(tokenizer_dir: Path | None, vocab_size: int) -> dict[str, Any] | None:
    """GPT-2-style BPE metadata from tokenizer.json: tokens by id (padded to the model's vocab with
    unused placeholders), their types, merges and special ids. None when there is no byte-level BPE."""
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        return None
    vocab: dict[str, int] = dict(model["vocab"])
    special = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    vocab.update(special)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(_token_type("UNUSED"))] * vocab_size
    for tok, i in vocab.items():
        if i < vocab_size:
            tokens[i] = tok
            types[i] = int(_token_type("CONTROL" if tok in special else "NORMAL"))
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges", [])]
    from .hf import end_of_turn, special_token_ids

    conf_path = tokenizer_dir / "tokenizer_config.json"
    template = json.loads(conf_path.read_text()).get("chat_template") if conf_path.is_file() else None
    eot = end_of_turn(tokenizer_dir)
    return {"tokens": tokens, "types": types, "merges": merges, **special_token_ids(tokenizer_dir),
            "eot_token_id": eot[1] if eot else None, "chat_template": template if isinstance(template, str) else None}


def _token_type(name: str):
    import gguf

    return getattr(gguf.TokenType, name)


def write_gguf(sd: dict[str, torch.Tensor], cfg: ModelConfig, path: str | Path, variant: str,
               tokenizer_dir: str | Path | None = None, name: str = "eightfold") -> dict[str, Any]:
    """One GGUF file for `variant` (gguf-f16, gguf-bf16, gguf-q8_0, gguf-q4_0) from our state dict."""
    import gguf

    check_supported(cfg)
    kinds = {
        "gguf-f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
        "gguf-bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
        "gguf-q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
        "gguf-q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    }
    if variant not in kinds:
        raise ValueError(f"unknown GGUF variant {variant!r}; known: {', '.join(kinds)}")
    qtype, ftype = kinds[variant]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name(name)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.moe.ffn_dim or cfg.ffn_dim if cfg.moe is not None else cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_size)
    w.add_value_length(cfg.head_size)
    w.add_rope_dimension_count(cfg.head_size)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tok = tokenizer_metadata(Path(tokenizer_dir) if tokenizer_dir else None, cfg.vocab_size)
    if tok is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")  # byte-level BPE with GPT-2's pre-tokenizer regex
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                         ("pad_token_id", w.add_pad_token_id)):
            if tok.get(key) is not None:
                add(tok[key])
        w.add_add_bos_token(False)  # our tokenizer adds no BOS when encoding plain text
        if tok.get("eot_token_id") is not None:  # llama.cpp ends a chat turn on its end-of-generation ids
            w.add_eot_token_id(tok["eot_token_id"])
        if tok.get("chat_template"):
            w.add_chat_template(tok["chat_template"])
    if cfg.moe is not None:
        w.add_expert_count(cfg.moe.num_experts)
        w.add_expert_used_count(cfg.moe.top_k)
        w.add_expert_feed_forward_length(cfg.moe.ffn_dim or cfg.ffn_dim)
    for key, t in sorted(_gguf_tensors(sd, cfg).items()):
        if key == "lm_head.weight" and cfg.tie_embeddings:
            continue  # llama.cpp reuses token_embd when output.weight is absent
        t = t.detach().float()
        if key.endswith("self_attn.q_proj.weight"):
            t = permute_rope_rows(t, cfg.n_heads)
        elif key.endswith("self_attn.k_proj.weight"):
            t = permute_rope_rows(t, cfg.kv_heads)
        arr = t.numpy()
        if arr.ndim == 1 or key.endswith("mlp.gate.weight"):
            w.add_tensor(gguf_name(key), arr.astype(np.float32))
            continue
        tq = qtype
        if variant == "gguf-q4_0" and key in ("embed_tokens.weight", "lm_head.weight"):
            tq = gguf.GGMLQuantizationType.Q8_0
        if tq == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(key), arr.astype(np.float16))
        else:
            w.add_tensor(gguf_name(key), gguf.quants.quantize(arr, tq), raw_dtype=tq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"file": path.name, "bytes": path.stat().st_size}


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata {key: value}, our-named float32 state dict) from a GGUF file this module wrote: blocks
    dequantized and the RoPE row permutation undone."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
            continue
        meta[key] = field.contents()
    n_heads = int(meta["llama.attention.head_count"])
    n_kv = int(meta["llama.attention.head_count_kv"])
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml lists dimensions innermost first
        arr = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (
            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else np.asarray(t.data)
        x = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)
        name = our_name(t.name)
        if name.endswith("self_attn.q_proj.weight"):
            x = unpermute_rope_rows(x, n_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            x = unpermute_rope_rows(x, n_kv)
        if ".mlp.experts." in name:  # stacked [E, out, in] -> one tensor per expert
            prefix, proj = name.rsplit(".experts.", 1)
            for e in range(x.shape[0]):
                sd[f"{prefix}.experts.{e}.{proj}"] = x[e].clone()
            continue
        sd[name] = x
    if "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    return meta, sd
