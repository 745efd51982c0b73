"""Speculative decoding with the model's own MTP modules (stages/serve/mtp_proposer.py): greedy output
identical to plain decoding, every draft equal to what the training model's MTP depths predict
(trainer/model/mtp.py, recomputed over the whole sequence), acceptance counted per position, and the
exact rejection sampler keeps the target distribution with MTP draft distributions."""

from __future__ import annotations

import shutil

import pytest
import torch
from scipy.stats import chisquare

from infra.config.model import ModelConfig
from stages.export.hf import from_hf_state_dict, read_mtp_sidecar, read_safetensors, write_mtp_sidecar
from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams
from stages.serve.speculative import rejection_sample
from test_serve_speculative import CODE

DEPTH = 2


@pytest.fixture(scope="module")
def mtp_dir(tiny_hf_model_dir, tmp_path_factory):
    """The tiny target with a 2-depth MTP sidecar built from its own first layer: depth k's projection
    passes the embedding of token i+k on and its block is layer 0, so (the target's later layers being
    scaled down) its drafts often agree with the target and acceptance is exercised."""
    out = tmp_path_factory.mktemp("mtp") / "model"
    shutil.copytree(tiny_hf_model_dir, out)
    cfg = _config(out)
    ours = from_hf_state_dict(read_safetensors(out), cfg, "llama")
    H = cfg.dim
    mtp = {}
    for i in range(DEPTH):
        p = f"mtp.{i}."
        mtp[p + "hnorm.weight"] = torch.ones(H)
        mtp[p + "enorm.weight"] = torch.ones(H)
        mtp[p + "eh_proj.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
        mtp[p + "norm.weight"] = ours["norm.weight"].clone()
        for k, v in ours.items():
            if k.startswith("layers.0."):
                mtp[p + "block." + k.removeprefix("layers.0.")] = v.clone()
    write_mtp_sidecar(mtp, cfg.model_copy(update={"mtp_depth": DEPTH}), out, torch.float32)
    return out


def _config(folder) -> ModelConfig:
    import json

    from stages.export.hf import model_config_from_hf

    return model_config_from_hf(json.loads((folder / "config.json").read_text()))[0]


def _reference_drafts(model, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts by the training model: depth d's logits at position n-1 of the whole sequence,
    fed the earlier depths' drafts as the tokens beyond t_n."""
    drafts: list[int] = []
    n = len(tokens) - 1
    for d in range(1, k + 1):
        seq = torch.tensor([tokens + drafts + [0] * (k - len(drafts))])
        logits = []
        with torch.no_grad():
            model(seq, head=lambda h, head: None, mtp_heads=[
                (lambda h, head: logits.append(head(h))) for _ in range(model.cfg.mtp_depth)])
        drafts.append(int(logits[d - 1][0, n - 1].argmax()))
    return drafts


def test_mtp_greedy_equals_plain_and_drafts_match_the_training_model(mtp_dir):
    from trainer.model import Transformer

    depth, sd = read_mtp_sidecar(mtp_dir)
    cfg = _config(mtp_dir).model_copy(update={"mtp_depth": depth})
    model = Transformer(cfg).eval()
    model.load_state_dict({**from_hf_state_dict(read_safetensors(mtp_dir), cfg, "llama"), **sd})

    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLMEngine(mtp_dir, EngineConfig(num_kv_blocks=128))
    want = [o.token_ids for o in plain.generate(CODE, params)]
    spec = LLMEngine(mtp_dir, EngineConfig(num_kv_blocks=128, speculative="mtp", num_speculative_tokens=4))
    assert spec.proposer.k == DEPTH  # k <= D
    checked = []
    propose = spec.proposer.propose

    def checking(reqs, block_ids):
        propose(reqs, block_ids)
        for r in reqs:
            if r.spec_token_ids and len(checked) < 12:  # a dozen rounds, prompt and later ones
                assert r.spec_token_ids == _reference_drafts(model, list(r.token_ids), len(r.spec_token_ids))
                checked.append(r.request_id)

    spec.proposer.propose = checking
    got = [o.token_ids for o in spec.generate(CODE, params)]
    assert got == want and len(checked) == 12
    labels = {"model_name": spec.model_name}
    drafts = spec.metrics.spec_drafts.value(**labels)
    first = spec.metrics.spec_accepted_per_pos.value(position="0", **labels)
    second = spec.metrics.spec_accepted_per_pos.value(position="1", **labels)
    assert 0 < second <= first <= drafts
    assert first + second == spec.metrics.spec_accepted.value(**labels)
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in spec.metrics.render()
    assert spec.num_steps < plain.num_steps
    assert spec.kv.num_allocated_blocks == 0


def test_mtp_verify_steps_run_compiled_with_the_same_output(mtp_dir):
    """With the decode step compiled (the server's default), MTP's verify steps run compiled too, writing
    the hidden states its drafts read: same tokens and same drafts as the eager engine."""
    from stages.serve.compiled_forward import CompiledLayerPass

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    opts = dict(num_kv_blocks=128, speculative="mtp", num_speculative_tokens=DEPTH)
    eager = LLMEngine(mtp_dir, EngineConfig(**opts))
    want = [o.token_ids for o in eager.generate(CODE, params)]
    compiled = LLMEngine(mtp_dir, EngineConfig(enforce_eager=False, **opts))
    pieces = compiled.model.pieces
    assert isinstance(pieces, CompiledLayerPass)
    warm = pieces.num_calls
    assert [o.token_ids for o in compiled.generate(CODE, params)] == want
    assert compiled.model.pieces is pieces and pieces.num_calls > warm + 5, "no verify step ran compiled"
    labels = lambda e: {"model_name": e.model_name}  # noqa: E731
    assert compiled.metrics.spec_accepted.value(**labels(compiled)) == eager.metrics.spec_accepted.value(**labels(eager))


def test_mtp_sampling_keeps_the_target_distribution(mtp_dir):
    """The sampled engine runs end to end with MTP drafts; and chi-square on the first token from the
    rejection sampler, its drafts drawn from the distributions the MTP depths gave in that run (cut to
    their 6 likeliest tokens so 6000 trials resolve them) against a target distribution over the same 6."""
    spec = LLMEngine(mtp_dir, EngineConfig(num_kv_blocks=128, speculative="mtp", num_speculative_tokens=2))
    captured = {}
    propose = spec.proposer.propose

    def capture(reqs, block_ids):
        propose(reqs, block_ids)
        for r in reqs:
            if r.spec_draft_probs is not None and "q" not in captured:
                captured["q"] = r.spec_draft_probs.clone()

    spec.proposer.propose = capture
    outs = spec.generate(CODE, SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in outs)
    q_full = captured["q"]  # [2, V]
    top = q_full[0].topk(6).indices
    q = q_full[:, top] / q_full[:, top].sum(-1, keepdim=True)
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(3, 6, generator=g) * 1.5
    trials, counts = 6000, torch.zeros(6)
    params = SamplingParams(temperature=1.0)
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        counts[rejection_sample(p_logits, drafts, q, params, g)[0]] += 1
    p = torch.softmax(p_logits, -1)
    assert chisquare(counts.numpy(), (p[0] * trials).numpy()).pvalue > 1e-3
    assert chisquare(counts.numpy(), (q[0] * trials).numpy()).pvalue < 1e-6  # and it can fail


def test_bench_reports_mtp_speedup_beside_ngram(mtp_dir):
    """`bench serve --speculative mtp --spec-prompts-file ...` times MTP and n-gram against plain
    decoding on the given prompts (spec_benchmark): greedy output identical, k capped at the depth, the
    first draft's acceptance reported."""
    from stages.serve.bench import spec_benchmark

    lines = spec_benchmark(str(mtp_dir), None, 1, 16, 3, repeats=1, methods=["mtp"], prompts=CODE[:1],
                           num_kv_blocks=64)
    spec = {d["method"]: d for d in lines}
    assert set(spec) == {"ngram", "mtp"}
    assert spec["mtp"]["num_speculative_tokens"] == DEPTH and spec["ngram"]["num_speculative_tokens"] == 3
    for d in spec.values():
        assert d["identical_greedy"] and d["spec_speedup"] > 0
    assert 0 < spec["mtp"]["acceptance_rate_first"] <= 1
