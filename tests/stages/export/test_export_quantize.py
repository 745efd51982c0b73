"""Quantized variants: the compressed-tensors bit layouts, error bounds of each scheme, every variant within
its threshold when loaded back through the reference dequantizer, INT8 as the W8A8 scheme vLLM selects,
the serving engine loading FP8 and serving W8A8, and AWQ beating round-to-nearest where activations have
outlier channels."""

from __future__ import annotations

import json

import pytest
import torch
from export_models import single_thread

from infra.config.export import ExportConfig
from stages.export.awq import awq_scale
from stages.export.hf import read_safetensors
from stages.export.quantize import (FP8_MAX, dequant_int4, fp8_per_channel, int4_groupwise, int8_per_channel, pack_int4,
                                    unpack_int4)
from stages.export.stage import write_quantized_folder
from stages.export.validate import (CheckData, build_reference, check_variant, folder_forward, load_hf_folder,
                                    our_forward)


def test_int4_packing_matches_compressed_tensors_bit_order():
    q = torch.randint(-8, 8, (3, 16), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    for r in range(3):
        for w in range(2):
            word = sum((int(q[r, 8 * w + j]) + 8) << (4 * j) for j in range(8))  # value j at bits 4j..4j+3
            assert int(packed[r, w]) % 2**32 == word
    assert torch.equal(unpack_int4(packed, (3, 16)), q)
    odd = q[:, :13]
    assert torch.equal(unpack_int4(pack_int4(odd), (3, 13)), odd)  # padded to whole words


def test_error_bounds_of_each_scheme():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q8, s8 = int8_per_channel(w)
    assert ((q8.float() * s8 - w).abs() <= s8 / 2 + 1e-6).all()
    q4, s4 = int4_groupwise(w, 128)
    assert s4.shape == (64, 2) and q4.min() >= -8 and q4.max() <= 7
    groups_scale = s4.repeat_interleave(128, dim=1)
    assert ((dequant_int4(q4, s4) - w).abs() <= groups_scale / 2 + 1e-6).all()
    qf, sf = fp8_per_channel(w)
    assert qf.dtype == torch.float8_e4m3fn and (qf.float().abs().amax(dim=1) <= FP8_MAX).all()
    big = (w / sf).abs() >= 2**-6  # e4m3's normal range (3 mantissa bits: relative rounding <= 2^-4)
    rel = ((qf.float() * sf - w).abs() / w.abs())[big]
    assert rel.max() <= 2**-4 + 1e-6


@pytest.fixture(scope="module")
def reference(trained_tiny, export_tokenizer_dir):
    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    prompts = [trained_tiny.val_rows[i, :6].tolist() for i in range(3)]
    data = CheckData(trained_tiny.val_rows, prompts, greedy_tokens=12)
    with single_thread():
        return data, build_reference(our_forward(sd, cfg), data)


@pytest.mark.parametrize("variant", ["fp8", "int8", "int4", "int4-awq"])
def test_variant_layout_and_threshold(tmp_path, variant, trained_tiny, export_tokenizer_dir, reference):
    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    ec = ExportConfig(awq_grid=8)
    src = sd
    if variant == "int4-awq":
        src, losses = awq_scale(sd, cfg, trained_tiny.train_rows[:8], 128, ec.awq_grid)
        assert losses["loss_awq"] <= losses["loss_rtn"]
    scheme = "int4" if variant.startswith("int4") else variant
    write_quantized_folder(src, cfg, tmp_path, scheme, "bfloat16", 128, True, export_tokenizer_dir, 4900, "auto")
    tensors = read_safetensors(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    q = "model.layers.1.mlp.down_proj."
    if scheme == "fp8":
        assert conf["format"] == "float-quantized" and tensors[q + "weight"].dtype == torch.float8_e4m3fn
        assert tensors[q + "weight_scale"].shape == (cfg.dim, 1)
        assert conf["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    elif scheme == "int8":
        assert conf["format"] == "int-quantized" and tensors[q + "weight"].dtype == torch.int8
    else:
        assert conf["format"] == "pack-quantized" and q + "weight" not in tensors
        assert tensors[q + "weight_packed"].shape == (cfg.dim, cfg.ffn_dim // 8)
        assert tensors[q + "weight_scale"].shape == (cfg.dim, cfg.ffn_dim // 128)
        assert tensors[q + "weight_shape"].tolist() == [cfg.dim, cfg.ffn_dim]
        assert conf["config_groups"]["group_0"]["weights"]["group_size"] == 128
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # not quantized
    data, ref = reference
    th = ec.thresholds[variant]
    rep = check_variant(variant, folder_forward(tmp_path), ref, data, th.max_ppl_ratio, th.min_greedy_agreement)
    assert rep.passed, rep.failures
    assert rep.max_logit_diff > 0  # it really is quantized


def test_serving_engine_loads_fp8_variant(tmp_path, trained_tiny, export_tokenizer_dir):
    """stages/serve's PagedLlama reads weight + weight_scale; its logits equal our model's on the same
    dequantized weights."""
    from stages.serve.model import KVCacheTensors, PagedLlama, run_paged

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    write_quantized_folder(sd, cfg, tmp_path, "fp8", "float32", 128, False, export_tokenizer_dir, 4900, "auto")
    engine = PagedLlama.from_pretrained(tmp_path, dtype=torch.float32)
    cache = KVCacheTensors(engine.shape, num_blocks=8, block_size=16, dtype=torch.float32, device=torch.device("cpu"))
    tokens = trained_tiny.val_rows[0, :20].tolist()
    served = run_paged(engine, cache, [([0, 1], 0, tokens)], [list(range(20))])
    deq, _, _ = load_hf_folder(tmp_path)
    ours = our_forward(deq, cfg)(torch.tensor([tokens]))[0]
    assert (served - ours).abs().max() < 1e-3


def test_int8_export_is_the_w8a8_scheme_vllm_selects(tmp_path, trained_tiny, export_tokenizer_dir):
    """The INT8 variant's quantization_config, parsed by compressed-tensors itself (as vLLM's
    CompressedTensorsConfig._quantization_scheme_map_from_config parses each group), holds what vLLM's
    `_is_dynamic_token_w8a8` asks for to pick CompressedTensorsW8A8Int8 (vllm/model_executor/layers/
    quantization/compressed_tensors/compressed_tensors.py): 8-bit int symmetric static per-channel
    weights, 8-bit int symmetric dynamic per-token inputs, under an activation-quantization format;
    compressed-tensors' own format inference names that format for the scheme; the tensors have the
    shapes CompressedTensorsW8A8Int8 creates (int8 [out, in], a [out, 1] scale, no input scale)."""
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, QuantizationStrategy,
                                                 QuantizationType)

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    write_quantized_folder(sd, cfg, tmp_path, "int8", "bfloat16", 128, True, export_tokenizer_dir, 4900, "auto")
    raw = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    conf = QuantizationConfig.model_validate(raw)
    assert raw["quant_method"] == "compressed-tensors" and conf.quantization_status == QuantizationStatus.COMPRESSED
    assert conf.format == CompressionFormat.int_quantized.value
    [scheme] = conf.config_groups.values()
    w, a = scheme.weights, scheme.input_activations
    assert (w.num_bits, w.type, w.symmetric, w.strategy, w.dynamic) == \
        (8, QuantizationType.INT, True, QuantizationStrategy.CHANNEL, False)
    assert a is not None and (a.num_bits, a.type, a.symmetric, a.strategy, a.dynamic) == \
        (8, QuantizationType.INT, True, QuantizationStrategy.TOKEN, True)
    assert scheme.targets == ["Linear"] and raw["config_groups"]["group_0"]["format"] == "int-quantized"
    assert infer_module_format(torch.nn.Linear, scheme) == CompressionFormat.int_quantized
    assert {"lm_head", "re:.*embed_tokens.*", "re:.*norm.*"} <= set(conf.ignore)

    tensors = read_safetensors(tmp_path)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        base = name[: -len("weight")]
        assert tensors[name].dtype == torch.int8, name
        assert tensors[base + "weight_scale"].dtype == torch.float32
        assert tensors[base + "weight_scale"].shape == (tensors[name].shape[0], 1)
        assert base + "input_scale" not in tensors and base + "weight_zero_point" not in tensors


def test_serving_engine_serves_w8a8_close_to_the_unquantized_model(tmp_path, trained_tiny, export_tokenizer_dir,
                                                                    reference):
    """Our engine keeps the INT8 variant's weights int8 and rounds each linear's inputs per token as the
    config declares (quant_linear.Int8ChannelWeight). Its logits equal the export validation's W8A8
    model (our trainer's model on the dequantized weights with int8 per-token input rounding hooks) up
    to float rounding: measured 4e-6; 1e-2 leaves room for an input lying within float error of a
    rounding boundary and rounding the other way in one of the two (one step, max|x| / 127, of one
    element), a small part of the quantization's own effect (5e-2 to 9e-2 here). Against the unquantized
    model the engine's own logits pass the export stage's INT8 thresholds (perplexity ratio <= 1.02,
    greedy agreement >= 0.6)."""
    from stages.serve.model import KVCacheTensors, PagedLlama, run_paged
    from stages.serve.quant_linear import Int8ChannelWeight

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    write_quantized_folder(sd, cfg, tmp_path, "int8", "float32", 128, True, export_tokenizer_dir, 4900, "auto")
    engine = PagedLlama.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(isinstance(engine.layers[0][k], Int8ChannelWeight) and engine.layers[0][k].int8_inputs
               for k in ("qkv", "o", "gate_up", "down"))

    def served(tokens: torch.Tensor) -> torch.Tensor:
        out = []
        for row in tokens.tolist():
            n = len(row)
            cache = KVCacheTensors(engine.shape, num_blocks=-(-n // 16), block_size=16, dtype=torch.float32,
                                   device=torch.device("cpu"))
            out.append(run_paged(engine, cache, [(list(range(-(-n // 16))), 0, row)], [list(range(n))]))
        return torch.stack(out)

    tokens = trained_tiny.val_rows[:2, :40]
    assert (served(tokens) - folder_forward(tmp_path)(tokens)).abs().max() < 1e-2
    data, ref = reference
    th = ExportConfig().thresholds["int8"]
    rep = check_variant("int8", served, ref, data, th.max_ppl_ratio, th.min_greedy_agreement)
    assert rep.passed, rep.failures
    assert rep.max_logit_diff > 0


def test_awq_beats_rtn_with_outlier_channels(trained_tiny):
    """Make channels 0..7 of every attention input 30x larger (and their q/k/v columns 30x smaller: the
    same function). RTN then loses those small weights inside groups scaled by the others; AWQ scales
    them back up.

    What AWQ guarantees is a smaller output reconstruction error, so that is what is compared: on the
    calibration objective, and end to end as the KL divergence of the int4-dequantized model's next-token
    distribution from the unquantized model's on held-out rows. Perplexity is not compared: on this briefly
    trained model int4 noise moves it by < 1% either way (RTN's ratio was 0.979..1.011 over 16 seeds, often
    *below* 1 and below AWQ's), a coin flip of the rounding.
    Measured over training seeds 0..15 (1 and 2 threads gave identical figures): loss_awq / loss_rtn
    0.29..0.66 (seed 0: 0.47), KL_awq / KL_rtn 0.06..0.18 (seed 0: 0.08). Bounds 0.8 and 0.25 leave
    >= 20% on the worst seed (0.7 on the calibration loss, the former bound, left 7%)."""
    import torch.nn.functional as F

    from stages.export.hf import DTYPES, from_hf_state_dict, to_hf_state_dict
    from stages.export.quantize import dequantize_state_dict, quantization_config, quantize_state_dict
    from stages.export.validate import logits_of

    cfg = trained_tiny.cfg
    sd = {k: v.clone() for k, v in trained_tiny.state_dict.items()}
    for i in range(cfg.n_layers):
        sd[f"layers.{i}.input_layernorm.weight"][:8] *= 30
        for n in "qkv":
            sd[f"layers.{i}.self_attn.{n}_proj.weight"][:, :8] /= 30
    rows = trained_tiny.val_rows  # held out: not the calibration rows
    ref = F.log_softmax(logits_of(our_forward(sd, cfg), rows), dim=-1)

    def int4_kl(src):
        """Mean per-token KL(unquantized || int4 of src) on the held-out rows."""
        hf = to_hf_state_dict(src, cfg, "llama", DTYPES["float32"])
        deq = dequantize_state_dict(quantize_state_dict(hf, "int4", 128), quantization_config("int4"))
        logp = F.log_softmax(logits_of(our_forward(from_hf_state_dict(deq, cfg, "llama"), cfg), rows), dim=-1)
        return float((ref.exp() * (ref - logp)).sum(-1).mean())

    scaled, losses = awq_scale(sd, cfg, trained_tiny.train_rows[:8], 128, 10)
    assert losses["loss_awq"] <= losses["loss_rtn"]  # by construction: alpha = 0 (RTN) is on the grid
    assert losses["loss_awq"] < 0.8 * losses["loss_rtn"]
    kl_awq, kl_rtn = int4_kl(scaled), int4_kl(sd)
    assert 0 < kl_awq < 0.25 * kl_rtn, (kl_awq, kl_rtn)
    # the scaled model is the same function before rounding
    tokens = trained_tiny.val_rows[:2, :-1]
    assert (our_forward(scaled, cfg)(tokens) - our_forward(sd, cfg)(tokens)).abs().max() < 1e-3


@pytest.mark.parametrize("scheme", ["fp8", "int8", "int4"])
def test_compressed_tensors_library_reads_our_layout(tmp_path, scheme, trained_tiny, export_tokenizer_dir):
    """The compressed-tensors library itself (through transformers) decompresses our files to the same
    weights as our reference dequantizer: the layout is the standard one, not merely self-consistent."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    cfg, sd = trained_tiny.cfg, trained_tiny.state_dict
    write_quantized_folder(sd, cfg, tmp_path, scheme, "float32", 128, False, export_tokenizer_dir, 4900, "auto")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    tokens = trained_tiny.val_rows[:1, :20]
    with torch.no_grad():
        theirs = model(tokens).logits
    deq, _, _ = load_hf_folder(tmp_path)
    ours = our_forward(deq, cfg)(tokens)
    assert (theirs - ours).abs().max() < 1e-4
    assert (ours - our_forward(sd, cfg)(tokens)).abs().max() > 1e-4  # and the weights really were quantized
