"""A llama.cpp GGUF file (`llama` architecture) read for the serving engine with `gguf.GGUFReader`.

The model's shape comes from the file's `llama.*` metadata, turned into the Hugging Face config keys
`LlamaShape` reads; the tensors get their Hugging Face names. Q8_0 and Q4_0 tensors stay block-quantized
(quant_linear.GGUFBlockWeight, dequantized on the fly); F16, BF16 and F32 ones become plain tensors.

q_proj / k_proj rows are stored in llama.cpp's RoPE order (adjacent pairs rotated together) and go back to
the half-split order our forward rotates, per head: the inverse of the permutation llama.cpp's converter
applies (see stages/export/gguf_export.py). Blocks run along a row, so permuting whole rows of blocks is
exact for the quantized types too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .quant_linear import GGUFBlockWeight

# llama.cpp tensor names (gguf.TENSOR_NAMES for MODEL_ARCH.LLAMA) -> Hugging Face Llama names
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a dense Llama (mixture-of-experts and other "
                     f"architectures are not served by this engine)")


def find_gguf(path: str | Path) -> Path | None:
    """The .gguf file at `path` or the only one inside the folder `path`; None when there is none."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(files) > 1:
        raise ValueError(f"{path} holds several GGUF files ({[f.name for f in files]}); name one")
    return files[0] if files else None


def read_metadata(reader) -> dict[str, Any]:
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.") and k not in skip}


def _f32(value) -> float:
    """GGUF stores these floats as float32: the shortest decimal that round-trips float32 is the value the
    writer meant (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], vocab_rows: int) -> dict[str, Any]:
    """config.json keys from `llama.*` metadata (what LlamaShape.from_hf_config reads)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    if meta.get("llama.expert_count"):
        raise ValueError("mixture-of-experts GGUF files are not supported by this engine (serve them with llama.cpp)")

    def need(key: str):
        if key not in meta:
            raise KeyError(f"GGUF metadata has no {key!r}")
        return meta[key]

    heads = int(need("llama.attention.head_count"))
    dim = int(need("llama.embedding_length"))
    head_dim = int(meta.get("llama.attention.key_length", dim // heads))
    if int(meta.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial RoPE (llama.rope.dimension_count < head size) is not supported")
    conf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", vocab_rows)),
        "hidden_size": dim,
        "intermediate_size": int(need("llama.feed_forward_length")),
        "num_hidden_layers": int(need("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(need("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("llama.context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (supported: none, linear)")
        conf["rope_scaling"] = {"rope_type": "linear", "factor": _f32(need("llama.rope.scaling.factor"))}
    return conf


def rope_row_order(rows: int, heads: int) -> torch.Tensor:
    """Row index map: half-split row r of a head is llama.cpp's row order[r] (the inverse of
    gguf_export.permute_rope_rows, built on row indices so it can reorder blocks as well as floats)."""
    d = rows // heads
    return torch.arange(rows).reshape(heads, d // 2, 2).transpose(1, 2).reshape(rows)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json-style dict, Hugging Face-named weights) from a GGUF file: Q8_0 / Q4_0 tensors as
    GGUFBlockWeight, the rest as tensors in the file's own dtype (the model casts them)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise KeyError(f"{path} has no token_embd.weight")
    conf = hf_config_from_gguf(meta, names, int(embd.shape[-1]))
    heads, kv_heads = conf["num_attention_heads"], conf["num_key_value_heads"]
    sd: dict[str, Any] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # ggml lists dimensions innermost first
        data = torch.from_numpy(np.array(t.data))  # a copy: the reader's arrays are a read-only memmap
        kind = t.tensor_type
        if kind in (Q.Q8_0, Q.Q4_0):
            w: Any = GGUFBlockWeight.from_raw(kind.name, data.view(torch.uint8), shape, dtype)
        elif kind == Q.BF16:
            w = data.view(torch.uint8).view(torch.bfloat16).reshape(shape)
        elif kind in (Q.F16, Q.F32):
            w = data.reshape(shape)
        else:
            raise ValueError(f"GGUF tensor {t.name} has type {kind.name}; supported: F32, F16, BF16, Q8_0, Q4_0")
        for suffix, n in (("self_attn.q_proj.weight", heads), ("self_attn.k_proj.weight", kv_heads)):
            if name.endswith(suffix):
                order = rope_row_order(shape[0], n)
                w = w.permute_rows(order) if isinstance(w, GGUFBlockWeight) else w[order]
        sd[name] = w
    return conf, sd
