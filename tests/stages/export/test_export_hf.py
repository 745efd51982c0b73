"""The Hugging Face folder loads in transformers (an implementation that is not ours) with logits equal to
our model's: dense Llama, tied embeddings, QK-norm (Qwen3), Mixtral and Qwen2-MoE with a shared expert,
MoE trained with a capacity limit exported without dropping."""

from __future__ import annotations

import json

import pytest
import torch
from export_models import random_model_state, tiny_cfg

from infra.config.model import MoEConfig
from stages.export.hf import ExportError, read_safetensors, write_hf
from stages.export.validate import our_forward


def transformers_logits(path, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits, model


def test_dense_export_matches_transformers_and_tokenizer_loads(tmp_path, trained_tiny, export_tokenizer_dir):
    from transformers import AutoTokenizer

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    # a small shard limit forces several shards, so the index is exercised
    info = write_hf(sd, cfg, tmp_path, dtype="float32", tokenizer_dir=export_tokenizer_dir, max_shard_mb=0.5)
    assert info["architecture"] == "LlamaForCausalLM" and len(info["files"]) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_safetensors(tmp_path))
    tokens = trained_tiny.val_rows[:2, :-1]
    ours = our_forward(sd, cfg)(tokens)
    theirs, model = transformers_logits(tmp_path, tokens)
    assert (ours - theirs).abs().max() < 1e-4
    conf = json.loads((tmp_path / "config.json").read_text())
    assert (conf["num_key_value_heads"], conf["head_dim"], conf["rms_norm_eps"], conf["rope_theta"]) == \
        (cfg.kv_heads, cfg.head_size, cfg.norm_eps, cfg.rope_theta)

    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(export_tokenizer_dir / "tokenizer.json"))
    text = "def main():\n    return 42\n"
    assert tok.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
    # the chat template's end of turn is a stop token everywhere the model travels: the shipped
    # tokenizer's EOS (a chat turn ends there) and, beside the document EOS, in generation_config.json
    from transformers import GenerationConfig

    end = raw.token_to_id("<|end|>")
    assert tok.eos_token_id == end and tok.eos_token == "<|end|>"
    assert conf["eos_token_id"] == raw.token_to_id("<|eos|>")
    assert GenerationConfig.from_pretrained(str(tmp_path)).eos_token_id == [conf["eos_token_id"], end]
    assert model.generation_config.eos_token_id == [conf["eos_token_id"], end]
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    rendered = tok.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert rendered.count(end) == 2 and rendered[-2] == end  # each turn closed by the stop token ("\n" after)


@pytest.mark.parametrize("kind,kw", [
    ("tied", dict(tie_embeddings=True)),
    ("qk_norm", dict(qk_norm=True)),
    ("mixtral", dict(moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0))),
    ("qwen2_moe", dict(moe=MoEConfig(num_experts=4, top_k=2, shared_expert=True, every=2, ffn_dim=64))),
    ("mtp", dict(mtp_depth=2)),  # the MTP modules go to the sidecar; the folder is the plain model's
])
def test_architectures_match_transformers(tmp_path, kind, kw):
    cfg = tiny_cfg(vocab_size=256, **kw)
    sd = random_model_state(cfg)
    info = write_hf(sd, cfg, tmp_path, dtype="float32")
    expected = {"tied": "LlamaForCausalLM", "qk_norm": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "mtp": "LlamaForCausalLM"}[kind]
    assert info["architecture"] == expected
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = our_forward(sd, cfg)(tokens)  # inference routing: no capacity dropping
    theirs, _ = transformers_logits(tmp_path, tokens)
    assert (ours - theirs).abs().max() < 1e-4
    if kind == "mtp":
        from stages.export.hf import read_mtp_sidecar

        assert info["mtp_files"] == ["mtp.safetensors", "mtp.json"]
        assert not any("mtp" in k for k in read_safetensors(tmp_path))  # the index names the main shards only
        depth, mtp = read_mtp_sidecar(tmp_path)
        want = {k: v for k, v in sd.items() if k.startswith("mtp.")}
        assert depth == 2 and mtp.keys() == want.keys() and "mtp.1.block.mlp.down_proj.weight" in mtp
        assert all(torch.equal(mtp[k], want[k]) for k in want)
    if kind == "mixtral":
        names = read_safetensors(tmp_path)
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names  # Mixtral's on-disk names
        # the training model with capacity 1.0 drops tokens; the export must not
        from trainer.model import Transformer

        train_model = Transformer(cfg)
        train_model.load_state_dict(sd)
        with torch.no_grad():
            dropped = train_model(tokens)
        assert float(train_model.layers["0"].mlp.dropped_fraction) > 0
        assert (dropped - theirs).abs().max() > 1e-3


def test_routing_bias_is_refused(tmp_path):
    cfg = tiny_cfg(moe=MoEConfig(num_experts=4, top_k=2, balance="bias"))
    sd = random_model_state(cfg)
    sd["layers.0.mlp.expert_bias"] = torch.tensor([0.1, 0.0, -0.1, 0.0])
    with pytest.raises(ExportError, match="expert_bias.*routing would differ"):
        write_hf(sd, cfg, tmp_path, dtype="float32")
