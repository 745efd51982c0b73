"""The post-train steps end to end through the local launcher (a trainer job per step) on a tiny model:
SFT with LoRA (PEFT adapter written), DPO, GRPO with one-step-stale rollouts from the serving engine;
each step's artifact holds its model, data, metrics and the held-out accuracy before/after; the
registry chains the three steps."""

import json

import pytest

from fixtures.posttrain import make_base, make_chat_tokenizer, make_tokens, posttrain_config
from infra.workspace import Workspace
from stages.base import StageContext
from stages.export.merge import find_checkpoint, load_full_state_dict
from stages.posttrain.perplexity import LanguageModelLost
from stages.posttrain.stage import run, run_sft
from stages.registry import STAGES, downstream


def test_registry_chains_the_steps():
    assert STAGES["posttrain-sft"].inputs == ("pretrain", "tokenizer", "tokens")
    assert STAGES["posttrain-dpo"].inputs == ("posttrain-sft", "tokenizer", "tokens")
    assert STAGES["posttrain-grpo"].inputs == ("posttrain-dpo", "tokenizer", "tokens")
    assert {"posttrain-dpo", "posttrain-grpo"} <= downstream("posttrain-sft")
    cfg = posttrain_config()
    a = STAGES["posttrain-grpo"].section(cfg)
    cfg.posttrain.sft.steps = 70  # SFT's settings are not GRPO's own fingerprint input
    assert STAGES["posttrain-grpo"].section(cfg) == a and "grpo" in a


@pytest.mark.slow
def test_three_steps_end_to_end(tmp_path):
    tok = make_chat_tokenizer(tmp_path / "tok")
    cfg = posttrain_config(
        sft={"steps": 3, "warmup_steps": 1, "num_examples": 64, "lora": {"enabled": True, "r": 4},
             "replay_fraction": 0.25},
        dpo={"steps": 2, "warmup_steps": 0, "num_examples": 32, "preference_pairs": 16},
        grpo={"steps": 2, "num_examples": 16, "prompts_per_step": 2, "group_size": 4, "global_batch_size": 8,
              "micro_batch_size": 8, "async_rollouts": True, "beta": 0.05},
        task={"heldout_size": 8},
    )
    cfg.infra.workdir = str(tmp_path / "ws")
    logged = []
    ctx = StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out",
                       inputs={"pretrain": make_base(tmp_path / "pretrain", cfg, tok), "tokenizer": tok,
                               "tokens": make_tokens(tmp_path / "tokens", tok)},
                       log_metrics=lambda m, step=None: logged.append(m))
    result = run(ctx)
    out = tmp_path / "out"
    for step in ("sft", "dpo", "grpo"):
        summary = json.loads((out / step / "posttrain.json").read_text())
        assert summary["heldout_n"] == 8 and 0 <= summary["heldout_accuracy_after"] <= 1
        bits_before, bits_after = summary["heldout_accuracy_before_outcomes"], summary["heldout_accuracy_after_outcomes"]
        assert len(bits_before) == len(bits_after) == 8 and summary["heldout_accuracy_after_count"] == bits_after.count("1")
        gains = [int(a) - int(b) for b, a in zip(bits_before, bits_after)]
        assert summary["heldout_accuracy_gain"] == pytest.approx(sum(gains) / 8)
        assert summary["heldout_accuracy_gain_se"] >= 0 and summary["heldout_accuracy_after_se"] >= 0
        assert (out / step / "data" / "train.jsonl").is_file()
        # what the step cost the language model, against the pretrained model's perplexity on the same rows
        assert summary["heldout_ppl_rows"] == 16 and summary["heldout_ppl_after"] > 1
        assert summary["heldout_ppl_ratio"] == pytest.approx(summary["heldout_ppl_after"] / summary["heldout_ppl_pretrained"])
        pretrained = json.loads((out / "sft" / "posttrain.json").read_text())["heldout_ppl_before"]
        assert summary["heldout_ppl_pretrained"] == pytest.approx(pretrained)
        assert json.loads((out / step / "result.json").read_text())["status"] == "completed"
        sd = load_full_state_dict(find_checkpoint(out / step))  # what the next step and export read
        assert "layers.0.self_attn.q_proj.weight" in sd and not any("lora" in k for k in sd)
    assert (out / "sft" / "adapter" / "adapter_config.json").is_file()
    assert not (out / "dpo" / "adapter").exists()
    metrics = [json.loads(line) for line in (out / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward_margin", "preference_accuracy", "logps_chosen", "logps_rejected"} <= set(metrics[-1])
    grpo = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(grpo) == 2 and {"reward_mean", "accuracy", "kl", "response_length", "rollout_s", "train_s"} <= set(grpo[-1])
    assert all(row["act_rms/layer_00"] > 0 for row in metrics + grpo)  # per-layer activation statistics
    assert "preference_accuracy_before" in result["dpo"] and "preference_accuracy_after" in result["dpo"]
    assert result["dpo"]["preference_pairs_n"] == 16 and "preference_accuracy_gain_se" in result["dpo"]
    assert not any(k.endswith("_outcomes") for k in result["dpo"])  # per-item outcomes stay in posttrain.json
    assert any("heldout_accuracy_after" in m for m in logged)
    assert (out / "model.safetensors").is_file()


def test_replay_rows_are_pretraining_windows(tmp_path):
    """SFT's replay rows: seq_len + 1 windows of the packed train split, loss on every token, one document,
    drawn without repeats, as many as make the asked share of the mixed rows."""
    import numpy as np

    from trainer.posttrain_data import replay_count, replay_rows
    from trainer.shards import PackedShards

    tok = make_chat_tokenizer(tmp_path / "tok")
    tokens = make_tokens(tmp_path / "tokens", tok, seq_len=64)
    shards = PackedShards(tokens / "train")
    rows = replay_rows(tokens / "train", 20, 31, seed=3)  # 65-token rows hold two 32-token windows each
    assert len(rows) == 20
    stream = {tuple(shards.row(i)[k * 32:(k + 1) * 32]) for i in range(len(shards)) for k in range(2)}
    assert all(tuple(ids) in stream and mask.all() and not docs.any() and len(ids) == 32 for ids, mask, docs in rows)
    assert len({tuple(ids) for ids, _, _ in rows}) == 20
    assert [r[0].tolist() for r in replay_rows(tokens / "train", 20, 31, seed=3)] == [r[0].tolist() for r in rows]
    assert replay_count(300, 0.25) == 100 and replay_count(300, 0.0) == 0
    with pytest.raises(ValueError, match="windows"):
        replay_rows(tokens / "train", len(shards) * 2 + 1, 31, seed=0)
    with pytest.raises(ValueError, match="shorter"):
        replay_rows(tokens / "train", 1, 99, seed=0)
    assert np.asarray(rows[0][0]).dtype == np.int64


@pytest.mark.slow
def test_step_that_unlearns_the_language_model_fails(tmp_path):
    """posttrain.max_heldout_ppl_ratio: an SFT step at a learning rate 30x too high on a briefly pretrained
    model raises held-out perplexity many times over (by construction: 5 steps at lr 0.1 on arithmetic
    alone), so the stage fails naming the figure, and commits nothing."""
    tok = make_chat_tokenizer(tmp_path / "tok")
    cfg = posttrain_config(sft={"steps": 5, "warmup_steps": 0, "num_examples": 64, "lr": 0.1},
                           task={"heldout_size": 4}, max_heldout_ppl_ratio=1.5)
    cfg.infra.workdir = str(tmp_path / "ws")
    ctx = StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out",
                       inputs={"pretrain": make_base(tmp_path / "pretrain", cfg, tok, steps=40), "tokenizer": tok,
                               "tokens": make_tokens(tmp_path / "tokens", tok)},
                       log_metrics=lambda m, step=None: None)
    with pytest.raises(LanguageModelLost, match=r"held-out pretraining perplexity .*x the pretrained .*max_heldout_ppl_ratio 1.5"):
        run_sft(ctx)
    summary = json.loads((tmp_path / "out" / "posttrain.json").read_text())
    assert summary["heldout_ppl_ratio"] > 1.5
