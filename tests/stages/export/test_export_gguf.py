"""GGUF: files read back with gguf.GGUFReader carry llama.* metadata, the tokenizer and the right tensor
shapes and types; each stays within its threshold; and the RoPE row permutation is the one llama.cpp
needs, checked against an independent implementation of its rotation of adjacent pairs."""

from __future__ import annotations

import pytest
import torch

from infra.config.export import ExportConfig
from stages.export.gguf_export import permute_rope_rows, write_gguf
from stages.export.validate import CheckData, build_reference, check_variant, gguf_forward, our_forward


@pytest.mark.parametrize("variant,linear_type", [("gguf-f16", "F16"), ("gguf-bf16", "BF16"), ("gguf-q8_0", "Q8_0"),
                                                 ("gguf-q4_0", "Q4_0")])
def test_gguf_reads_back(tmp_path, variant, linear_type, trained_tiny, export_tokenizer_dir):
    import gguf

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    path = tmp_path / "model.gguf"
    write_gguf(sd, cfg, path, variant, export_tokenizer_dir)
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == cfg.n_layers
    assert meta["llama.context_length"] == cfg.max_seq_len
    assert meta["llama.embedding_length"] == cfg.dim
    assert meta["llama.feed_forward_length"] == cfg.ffn_dim
    assert meta["llama.attention.head_count"] == cfg.n_heads
    assert meta["llama.attention.head_count_kv"] == cfg.kv_heads
    assert meta["llama.rope.dimension_count"] == cfg.head_size
    assert meta["llama.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.norm_eps)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == cfg.vocab_size
    assert meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.eos_token_id"]] == "<|eos|>"
    # llama.cpp ends a chat turn on the end-of-turn id and renders turns with the same template
    from stages.tokenizer import CHAT_TEMPLATE

    assert meta["tokenizer.ggml.tokens"][meta["tokenizer.ggml.eot_token_id"]] == "<|end|>"
    assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert len(meta["tokenizer.ggml.merges"]) > 0
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 9 * cfg.n_layers + 1
    # ggml lists dimensions innermost first: [in, out]
    assert list(tensors["token_embd.weight"].shape) == [cfg.dim, cfg.vocab_size]
    assert list(tensors["blk.1.attn_k.weight"].shape) == [cfg.dim, cfg.kv_heads * cfg.head_size]
    assert list(tensors["blk.1.ffn_down.weight"].shape) == [cfg.ffn_dim, cfg.dim]
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == linear_type
    assert tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"

    prompts = [trained_tiny.val_rows[i, :6].tolist() for i in range(3)]
    data = CheckData(trained_tiny.val_rows, prompts, greedy_tokens=12)
    ref = build_reference(our_forward(sd, cfg), data)
    th = ExportConfig().thresholds[variant]
    rep = check_variant(variant, gguf_forward(path, cfg), ref, data, th.max_ppl_ratio, th.min_greedy_agreement)
    assert rep.passed, rep.failures


def rope_adjacent_pairs(x, positions, theta):
    """llama.cpp's LLAMA_ROPE_TYPE_NORM, written from its definition: pair (x[2i], x[2i+1]) rotated by
    angle pos * theta^(-2i/d). x [S, heads, d]."""
    d = x.shape[-1]
    out = x.clone()
    for i in range(d // 2):
        ang = positions.float() * theta ** (-2 * i / d)
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i], out[..., 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def test_rope_permutation_matches_llama_cpp_rotation(trained_tiny):
    from trainer.model.transformer import apply_rope, rope_cos_sin

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    d, H, K = cfg.head_size, cfg.n_heads, cfg.kv_heads
    x = torch.randn(10, cfg.dim, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10)
    wq, wk = sd["layers.0.self_attn.q_proj.weight"], sd["layers.0.self_attn.k_proj.weight"]

    def scores(q, k):  # first query head against its KV head: [S, S]
        return q[:, 0] @ k[:, 0].t()

    cos, sin = rope_cos_sin(pos, d, cfg.rope_theta)
    q_hf = apply_rope((x @ wq.t()).view(10, H, d).transpose(0, 1), cos, sin).transpose(0, 1)
    k_hf = apply_rope((x @ wk.t()).view(10, K, d).transpose(0, 1), cos, sin).transpose(0, 1)
    q_cpp = rope_adjacent_pairs((x @ permute_rope_rows(wq, H).t()).view(10, H, d), pos, cfg.rope_theta)
    k_cpp = rope_adjacent_pairs((x @ permute_rope_rows(wk, K).t()).view(10, K, d), pos, cfg.rope_theta)
    assert torch.allclose(scores(q_hf, k_hf), scores(q_cpp, k_cpp), atol=1e-4)
    q_bad = rope_adjacent_pairs((x @ wq.t()).view(10, H, d), pos, cfg.rope_theta)  # no permutation
    k_bad = rope_adjacent_pairs((x @ wk.t()).view(10, K, d), pos, cfg.rope_theta)
    assert not torch.allclose(scores(q_hf, k_hf), scores(q_bad, k_bad), atol=1e-2)
