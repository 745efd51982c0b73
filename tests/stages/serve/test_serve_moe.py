"""Mixture-of-experts checkpoints through the serving engine: tiny MoE models of our trainer's
Transformer, exported by stages/export/hf.py to Mixtral, Qwen2-MoE (shared expert, dense layers in
between) and Qwen3-MoE (QK-norm), against two references computed elsewhere: Hugging Face
transformers on the exported folder (greedy generation, prompt log-probs) and our trainer's own MoE
layer on the same weights. Then the serve stage's smoke test, weight pushes (GRPO), quantized
experts and bad checkpoints."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from infra.config.model import ModelConfig, MoEConfig
from stages.export.hf import write_hf
from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.model import LlamaShape, PagedLlama
from stages.serve.moe import moe_mlp
from stages.serve.sampling import SamplingParams

ARCHS = {
    # capacity 1.0 drops tokens in training; inference (HF and the engine) must not
    "mixtral": dict(moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0)),
    "qwen2_moe": dict(moe=MoEConfig(num_experts=4, top_k=2, shared_expert=True, every=2, ffn_dim=64)),
    "qwen3_moe": dict(qk_norm=True, moe=MoEConfig(num_experts=4, top_k=2, ffn_dim=64)),
}
PROMPTS = [
    "def foo(x):\n    return",
    "import os\nclass A:",
    "x",
    # longer than the 16-token step budget: prefilled in chunks while the others decode
    "for i in range(10):\n    print(i)\n    if i % 3 == 0:\n        continue\n    total += i\n",
]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def tiny_cfg(kind: str) -> ModelConfig:
    return ModelConfig(vocab_size=1024, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256,
                       **ARCHS[kind])


def trainer_model(cfg: ModelConfig, seed: int = 0):
    """Our Transformer with random weights and non-trivial norms (all-ones norms hide norm mix-ups)."""
    from trainer.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_hf_model_dir):
    """kind -> (exported folder, our trainer model); the tokenizer is the serve tests' tiny one."""
    out = {}
    for kind in ARCHS:
        cfg = tiny_cfg(kind)
        model = trainer_model(cfg)
        path = tmp_path_factory.mktemp(kind)
        info = write_hf(model.state_dict(), cfg, path, dtype="float32", tokenizer_dir=tiny_hf_model_dir)
        assert info["model_type"] == kind
        out[kind] = (path, model)
    return out


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def engine_for(path, **kw) -> LLMEngine:
    return LLMEngine(path, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4, **kw))


@pytest.mark.parametrize("kind", list(ARCHS))
def test_greedy_and_logprobs_equal_transformers(exports, kind):
    path, _ = exports[kind]
    engine = engine_for(path, enforce_eager=False)  # compiling is refused for MoE, with a reason
    shape = engine.model.shape
    assert shape.moe_arch == kind and not engine.model.pieces.compiled
    assert shape.sparse_layers == ((1,) if kind == "qwen2_moe" else (0, 1))
    assert shape.norm_topk_prob and shape.shared_expert_intermediate_size == (64 if kind == "qwen2_moe" else 0)
    hf = hf_model(path)

    outs = engine.generate(PROMPTS, GREEDY)  # 4 requests sharing steps, the long one chunked
    assert len(engine.encode(PROMPTS[-1])) > 16
    for prompt, o in zip(PROMPTS, outs):
        ids = torch.tensor([engine.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        assert o.token_ids == ref, (kind, prompt)

    # log-probs of the prompt and of the generated tokens against HF's logits over the whole sequence
    o = engine.generate([PROMPTS[-1]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, prompt_logprobs=0))[0]
    ids = engine.encode(PROMPTS[-1]) + o.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n = len(ids) - len(o.token_ids)
    ours = [lp.logprob for lp in o.prompt_logprobs[1:]] + [lp.logprob for lp in o.logprobs]
    want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert len(ours) == len(want) == len(ids) - 1 and n > 16
    assert max(abs(a - b) for a, b in zip(ours, want)) < 1e-4
    assert engine.kv.num_allocated_blocks == 0


@pytest.mark.parametrize("kind", list(ARCHS))
def test_moe_mlp_equals_the_trainers_moe_layer(exports, kind):
    """A second reference: our trainer's MoE layer (no capacity limit) on the weights the engine loaded
    from the exported folder. For Qwen2-MoE that includes undoing the export's shared-expert trick (a
    zero sigmoid gate, the down projection doubled)."""
    path, model = exports[kind]
    engine_model = PagedLlama.from_pretrained(path)
    h = torch.randn(37, 64, generator=torch.Generator().manual_seed(3))
    for li in engine_model.shape.sparse_layers:
        layer = model.layers[str(li)].mlp
        layer.capacity_factor = None
        with torch.no_grad():
            want = layer(h)
        w = engine_model.layers[li]["moe"]
        got = moe_mlp(h, w)
        scale = want.abs().max()
        assert scale > 0 and (got - want).abs().max() < 1e-5 * scale, (kind, li)
        # and the comparison can fail: weights not renormalised over the k chosen differ from ours
        unnormed = moe_mlp(h, dataclasses.replace(w, norm_topk_prob=False))
        assert (unnormed - want).abs().max() > 0.1 * scale


def test_norm_topk_prob_false_is_followed(exports, tmp_path):
    """Qwen's `norm_topk_prob: false` (their default) weighs experts by the raw top-k probabilities:
    the engine must follow config.json as HF does (and the flag must change the result)."""
    src, _ = exports["qwen3_moe"]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, "norm_topk_prob": False}))
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompt = PROMPTS[0]
    raw, renorm = (LLMEngine(d, EngineConfig(num_kv_blocks=16)).generate([prompt], p)[0] for d in (tmp_path, src))
    ids = raw.prompt_token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(tmp_path)(torch.tensor([ids])).logits[0], -1)
    ours = torch.tensor([lp.logprob for lp in raw.prompt_logprobs[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (ours - want).abs().max() < 1e-4
    other = torch.tensor([lp.logprob for lp in renorm.prompt_logprobs[1:]])
    assert (ours - other).abs().max() > 1e-3


def test_serve_stage_smoke_test_passes_on_an_moe_export(exports):
    from stages.serve.stage import smoke_test

    smoke = smoke_test(exports["qwen2_moe"][0], max_tokens=8)
    assert smoke["matches_hf"], smoke
    assert len(smoke["engine_tokens"]) == 8


def test_grpo_rollout_engine_takes_moe_weight_pushes(exports, tmp_path):
    """GRPO's rollout engine (stages/posttrain/rollout.py) on an MoE policy: built from our trainer's
    weights, then pushed new ones through the export's name mapping; it must then generate what a
    rollout engine built on the new weights generates."""
    from stages.posttrain.rollout import ServingEngineRollouts

    tok_dir, _ = exports["qwen2_moe"]
    cfg = tiny_cfg("qwen2_moe")
    old, new = (trainer_model(cfg, seed=s).state_dict() for s in (0, 1))
    make = lambda sd, d: ServingEngineRollouts(model_cfg=cfg, state_dict=sd, tokenizer_dir=tok_dir,  # noqa: E731
                                               workdir=tmp_path / d, stop_token_ids=[], kv_cache_memory_gb=0.002)
    pushed = make(old, "a")
    prompts = [pushed.engine.encode(p) for p in PROMPTS[:2]]
    before = pushed.greedy(prompts, 8)
    pushed.update_weights(new)
    got = pushed.greedy(prompts, 8)
    assert got == make(new, "b").greedy(prompts, 8) and got != before


@pytest.mark.parametrize("scheme", ["int4", "fp8"])
def test_quantized_experts_equal_their_dequantized_weights(exports, tmp_path, scheme):
    """The export's quantized variants (experts quantized, routers not): INT4 experts stay packed
    (quant_linear.py), FP8 ones are dequantized at load; either way the engine's log-probs equal the
    engine's on the export's own reference dequantization of the same files."""
    from stages.export.hf import read_safetensors
    from stages.export.quantize import dequantize_state_dict, quantization_config, quantize_state_dict
    from safetensors.torch import save_file

    src, _ = exports["mixtral"]
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    for f in tmp_path.glob("*.safetensors*"):
        f.unlink()
    q = quantize_state_dict(read_safetensors(src), scheme, group=32)
    save_file(q, str(tmp_path / "model.safetensors"))
    conf = json.loads((tmp_path / "config.json").read_text())
    qcfg = quantization_config(scheme, 32)
    (tmp_path / "config.json").write_text(json.dumps({**conf, "quantization_config": qcfg}))
    engine = LLMEngine(tmp_path, EngineConfig(num_kv_blocks=16))
    moe = engine.model.layers[0]["moe"]
    assert type(moe.gate_up[0]).__name__ == ("Int4GroupWeight" if scheme == "int4" else "Tensor")
    assert isinstance(moe.router, torch.Tensor)
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    got = engine.generate(PROMPTS[:1], p)[0]
    engine.update_weights(dequantize_state_dict(q, qcfg, torch.float32))
    assert not any(type(t).__name__ == "Int4GroupWeight" for t in engine.model.layers[0]["moe"].gate_up)
    want = engine.generate(PROMPTS[:1], p)[0]
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:])]
    assert max(diffs) < 1e-4


def test_shape_follows_each_architectures_config_rules():
    """Which layers are sparse and whether the top-k weights are renormalised, as transformers decides
    them: Mixtral always sparse and renormalised; Qwen by `(i + 1) % decoder_sparse_step == 0` minus
    `mlp_only_layers`, `norm_topk_prob` defaulting to false; Qwen2-MoE's shared expert by its size."""
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                architectures=["X"])
    mix = LlamaShape.from_hf_config({**base, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                     "num_local_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False})
    assert (mix.sparse_layers, mix.norm_topk_prob, mix.moe_intermediate_size) == ((0, 1, 2, 3), True, 32)
    q2 = LlamaShape.from_hf_config({**base, "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
                                    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
                                    "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                    "shared_expert_intermediate_size": 0})
    assert (q2.sparse_layers, q2.norm_topk_prob, q2.shared_expert_intermediate_size) == ((1,), False, 0)
    q3 = LlamaShape.from_hf_config({**base, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                                    "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                                    "mlp_only_layers": [0]})
    assert (q3.sparse_layers, q3.norm_topk_prob, q3.moe_intermediate_size) == ((1, 2, 3), True, 768)


def test_bad_moe_checkpoints_are_named(exports, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = exports["mixtral"]
    conf = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="sliding_window=16"):
        LlamaShape.from_hf_config({**conf, "sliding_window": 16})
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        LlamaShape.from_hf_config({**conf, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="use_sliding_window"):
        LlamaShape.from_hf_config({**json.loads((exports["qwen3_moe"][0] / "config.json").read_text()),
                                   "use_sliding_window": True})
    with pytest.raises(ValueError, match="model_type='deepseek_v3'"):
        LlamaShape.from_hf_config({**conf, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]})
    with pytest.raises(ValueError, match="MoE as mixtral"):
        LlamaShape.from_hf_config({**conf, "model_type": "llama"})

    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    shape = LlamaShape.from_hf_config(conf)
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"}
    with pytest.raises(KeyError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight"):
        PagedLlama(shape, missing, torch.float32, torch.device("cpu"))
    bad = dict(sd)
    bad["model.layers.0.block_sparse_moe.gate.weight"] = torch.zeros(3, 64)
    with pytest.raises(ValueError, match=r"block_sparse_moe\.gate\.weight.*\(3, 64\)"):
        PagedLlama(shape, bad, torch.float32, torch.device("cpu"))
    from stages.export.quantize import int4_groupwise, pack_int4

    router = "model.layers.0.block_sparse_moe.gate"
    q, scale = int4_groupwise(sd[router + ".weight"], 32)
    packed = {k: v for k, v in sd.items() if k != router + ".weight"}
    packed.update({router + ".weight_packed": pack_int4(q), router + ".weight_scale": scale,
                   router + ".weight_shape": torch.tensor([4, 64])})
    with pytest.raises(ValueError, match=r"block_sparse_moe\.gate.*quantized"):
        PagedLlama(shape, packed, torch.float32, torch.device("cpu"))
    save_file({k: v for k, v in sd.items() if "experts.3." not in k}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(KeyError, match=r"experts\.3\.w1"):
        PagedLlama.from_pretrained(tmp_path)


def test_evaluate_engine_backend_scores_like_transformers(exports):
    """The evaluate stage's engine-backed loglikelihoods on an MoE export equal its transformers backend's."""
    from stages.evaluate.backends import EngineBackend, TransformersBackend

    path, _ = exports["qwen3_moe"]
    engine = EngineBackend(path, num_kv_blocks=32)
    enc = lambda t: engine.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
    requests = [(enc(a), enc(b)) for a, b in (("def foo(x):\n", "    return x"), ("import os\n", "import sys"),
                                                 ("x = 1\ny =", " 2"))]
    ours, theirs = engine.score(requests), TransformersBackend(path).score(requests)
    for (a, greedy_a), (b, greedy_b) in zip(ours, theirs):
        assert a == pytest.approx(b, abs=1e-4) and greedy_a == greedy_b
