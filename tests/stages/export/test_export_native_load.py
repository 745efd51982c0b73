"""The serving engine loads each packed variant from its own files and keeps it packed: INT4
(compressed-tensors pack-quantized, group 128) and GGUF Q8_0 / Q4_0 blocks in memory, dequantized per
forward. Its logits equal our model's on the weights an independent reader dequantizes (the export stage's
reference unpacker; gguf's numpy dequantizer), its greedy continuations equal that reference's, each variant
stays within its export threshold against the unquantized model, the INT4 / Q4_0 linears take about a
quarter of their bf16 bytes, and the GGUF metadata gives the same shape as the Hugging Face config."""

from __future__ import annotations

import pytest
import torch

from infra.config.export import ExportConfig
from stages.export import hf as hf_layout
from stages.export.gguf_export import write_gguf
from stages.export.stage import write_quantized_folder
from stages.export.validate import CheckData, build_reference, check_variant, folder_forward, gguf_forward, greedy, our_forward
from stages.serve.model import KVCacheTensors, LlamaShape, PagedLlama, run_paged
from stages.serve.quant_linear import GGUFBlockWeight, Int4GroupWeight, QuantizedWeight, weight_bytes

LINEARS = ("qkv", "o", "gate_up", "down")


def paged_forward(model: PagedLlama):
    """tokens [B, T] -> logits [B, T, V], each row one sequence through the paged forward."""
    def forward(tokens: torch.Tensor) -> torch.Tensor:
        T, bs = tokens.shape[1], 16
        blocks = list(range(-(-T // bs)))
        cache = KVCacheTensors(model.shape, len(blocks), bs, model.dtype, model.device)
        return torch.stack([run_paged(model, cache, [(blocks, 0, row.tolist())], [list(range(T))]) for row in tokens])
    return forward


def linear_bytes(model: PagedLlama) -> tuple[int, int]:
    """(resident bytes of the decoder linears, bytes the same weights take in bf16)."""
    ws = [L[k] for L in model.layers for k in LINEARS]
    return weight_bytes(ws), sum(w.shape[0] * w.shape[1] * 2 for w in ws)


@pytest.fixture(scope="module")
def check_data(trained_tiny):
    prompts = [trained_tiny.val_rows[i, :6].tolist() for i in range(3)]
    data = CheckData(trained_tiny.val_rows[:4], prompts, greedy_tokens=10)
    return data, build_reference(our_forward(trained_tiny.state_dict, trained_tiny.cfg), data)


def test_int4_folder_served_packed(tmp_path, trained_tiny, export_tokenizer_dir, check_data):
    from stages.serve.engine import EngineConfig, LLMEngine
    from stages.serve.sampling import SamplingParams

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    write_quantized_folder(sd, cfg, tmp_path, "int4", "bfloat16", 128, False, export_tokenizer_dir, 4900, "auto")
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64))
    model = engine.model
    for L in model.layers:
        assert all(isinstance(L[k], Int4GroupWeight) for k in LINEARS)
        assert L["qkv"].packed.dtype == torch.int32 and L["qkv"].group == 128
    assert not isinstance(model.embed, QuantizedWeight)  # embeddings and LM head stay in the export dtype
    packed, bf16 = linear_bytes(model)
    assert 0.2 < packed / bf16 < 0.3, (packed, bf16)  # 4 bits + a float32 scale per 128 weights: ~0.27

    data, ref = check_data
    reference = folder_forward(tmp_path)  # the export stage's own unpacker, dequantized up front
    tokens = data.rows[:2, :40]
    assert (paged_forward(model)(tokens) - reference(tokens)).abs().max() < 1e-3
    outs = engine.generate(data.prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(reference, p, 10) for p in data.prompts]
    th = ExportConfig().thresholds["int4"]
    rep = check_variant("int4", paged_forward(model), ref, data, th.max_ppl_ratio, th.min_greedy_agreement)
    assert rep.passed, rep.failures
    assert rep.max_logit_diff > 1e-3  # really quantized


@pytest.mark.parametrize("variant,kind", [("gguf-q8_0", "Q8_0"), ("gguf-q4_0", "Q4_0"), ("gguf-f16", None),
                                          ("gguf-bf16", None)])
def test_gguf_file_served_from_blocks(tmp_path, variant, kind, trained_tiny, export_tokenizer_dir, check_data):
    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    path = tmp_path / "model.gguf"
    write_gguf(sd, cfg, path, variant, export_tokenizer_dir)
    model = PagedLlama.from_pretrained(tmp_path, dtype=torch.float32)  # the folder, as export writes it

    ids = hf_layout.special_token_ids(export_tokenizer_dir)
    assert model.shape == LlamaShape.from_hf_config(hf_layout.hf_config(cfg, hf_layout.hf_architecture(cfg), "bfloat16", ids))
    assert (model.shape.num_heads, model.shape.num_kv_heads, model.shape.vocab_size) == (cfg.n_heads, cfg.kv_heads,
                                                                                        cfg.vocab_size)
    assert model.shape.rope_theta == cfg.rope_theta
    packed, bf16 = linear_bytes(model)
    if kind is None:
        assert all(isinstance(L[k], torch.Tensor) for L in model.layers for k in LINEARS)
    else:
        assert all(isinstance(L[k], GGUFBlockWeight) and L[k].kind == kind for L in model.layers for k in LINEARS)
        assert isinstance(model.embed, GGUFBlockWeight) and model.embed.kind == "Q8_0"  # llama.cpp's choice
        # Q8_0: 34 bytes per 32 weights (~0.53 of bf16); Q4_0: 18 per 32 (~0.28)
        assert packed / bf16 == pytest.approx(34 / 64 if kind == "Q8_0" else 18 / 64)

    data, ref = check_data
    reference = gguf_forward(path, cfg)  # gguf's numpy dequantizer, RoPE rows unpermuted by the export code
    tokens = data.rows[:2, :40]
    assert (paged_forward(model)(tokens) - reference(tokens)).abs().max() < 1e-3
    th = ExportConfig().thresholds[variant]
    rep = check_variant(variant, paged_forward(model), ref, data, th.max_ppl_ratio, th.min_greedy_agreement)
    assert rep.passed, rep.failures

    if variant == "gguf-q4_0":  # the engine itself serves the folder export writes (GGUF file + tokenizer)
        from stages.serve.engine import EngineConfig, LLMEngine
        from stages.serve.sampling import SamplingParams

        hf_layout.copy_tokenizer(export_tokenizer_dir, tmp_path)
        engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=64, dtype="float32"))
        outs = engine.generate(data.prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
        assert [o.token_ids for o in outs] == [greedy(reference, p, 10) for p in data.prompts]


def test_gguf_bad_files_are_named(tmp_path, trained_tiny):
    from stages.serve.gguf_loader import hf_config_from_gguf

    with pytest.raises(ValueError, match="mixture-of-experts"):
        hf_config_from_gguf({"general.architecture": "llama", "llama.expert_count": 8}, set(), 10)
    with pytest.raises(KeyError, match="llama.attention.head_count"):
        hf_config_from_gguf({"general.architecture": "llama"}, set(), 10)
    with pytest.raises(FileNotFoundError, match="config.json"):
        PagedLlama.from_pretrained(tmp_path)  # neither config.json nor a .gguf
