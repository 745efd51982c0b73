"""The post-train steps end to end through the local launcher (a trainer job per step) on a tiny model:
SFT with LoRA (PEFT adapter written), DPO, GRPO with one-step-stale rollouts from the serving engine;
each step's artifact holds its model, data, metrics and the held-out accuracy before/after; the
registry chains the three steps."""

import json

import pytest

from fixtures.posttrain import make_base, make_chat_tokenizer, posttrain_config
from infra.workspace import Workspace
from stages.base import StageContext
from stages.export.merge import find_checkpoint, load_full_state_dict
from stages.posttrain.stage import run
from stages.registry import STAGES, downstream


def test_registry_chains_the_steps():
    assert STAGES["posttrain-sft"].inputs == ("pretrain", "tokenizer")
    assert STAGES["posttrain-dpo"].inputs == ("posttrain-sft", "tokenizer")
    assert STAGES["posttrain-grpo"].inputs == ("posttrain-dpo", "tokenizer")
    assert {"posttrain-dpo", "posttrain-grpo"} <= downstream("posttrain-sft")
    cfg = posttrain_config()
    a = STAGES["posttrain-grpo"].section(cfg)
    cfg.posttrain.sft.steps = 70  # SFT's settings are not GRPO's own fingerprint input
    assert STAGES["posttrain-grpo"].section(cfg) == a and "grpo" in a


@pytest.mark.slow
def test_three_steps_end_to_end(tmp_path):
    tok = make_chat_tokenizer(tmp_path / "tok")
    cfg = posttrain_config(
        sft={"steps": 3, "warmup_steps": 1, "num_examples": 64, "lora": {"enabled": True, "r": 4}},
        dpo={"steps": 2, "warmup_steps": 0, "num_examples": 32, "preference_pairs": 16},
        grpo={"steps": 2, "num_examples": 16, "prompts_per_step": 2, "group_size": 4, "global_batch_size": 8,
              "micro_batch_size": 8, "async_rollouts": True, "beta": 0.05},
        task={"heldout_size": 8},
    )
    cfg.infra.workdir = str(tmp_path / "ws")
    logged = []
    ctx = StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out",
                       inputs={"pretrain": make_base(tmp_path / "pretrain", cfg, tok), "tokenizer": tok},
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
