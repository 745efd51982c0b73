"""Classic RLHF end to end through the local launcher on a tiny model: SFT -> reward model -> PPO
(posttrain.chain rm-ppo). The reward model's artifact holds its weights, the held-out pairwise accuracy with
its standard error and a Hugging Face sequence-classification export that transformers scores as we do;
PPO's holds the policy alone, per-step reward, KL, value loss, clip fraction and held-out accuracy, and the
reward model's score of the held-out answers before and after."""

import json

import pytest

from fixtures.posttrain import make_base, make_chat_tokenizer, make_tokens, posttrain_config
from infra.workspace import Workspace
from stages.base import StageContext
from stages.export.merge import find_checkpoint, load_full_state_dict
from stages.posttrain.stage import run
from stages.registry import STAGES, in_chain, stage_inputs


def test_registry_branches_from_sft():
    assert STAGES["posttrain-rm"].inputs == ("posttrain-sft", "tokenizer", "tokens")
    assert STAGES["posttrain-ppo"].inputs == ("posttrain-sft", "posttrain-rm", "tokenizer", "tokens")
    cfg = posttrain_config()
    assert cfg.posttrain.chain == "dpo-grpo" and not in_chain(cfg, "posttrain-ppo") and in_chain(cfg, "posttrain-grpo")
    assert "posttrain-ppo" not in stage_inputs(cfg, "export") and "posttrain-grpo" in stage_inputs(cfg, "export")
    cfg = posttrain_config(chain="rm-ppo")
    assert not in_chain(cfg, "posttrain-dpo") and in_chain(cfg, "posttrain-rm")
    assert stage_inputs(cfg, "export") == ("pretrain", "posttrain-sft", "posttrain-ppo", "tokenizer", "tokens")
    both = posttrain_config(chain="both")
    assert all(in_chain(both, f"posttrain-{s}") for s in ("sft", "dpo", "grpo", "rm", "ppo"))


def test_ppo_batch_sizes_are_checked():
    with pytest.raises(ValueError, match="global_batch_size \\* minibatches"):
        posttrain_config(ppo={"prompts_per_step": 4, "samples_per_prompt": 2, "global_batch_size": 3})


@pytest.mark.slow
def test_sft_rm_ppo_end_to_end(tmp_path):
    tok = make_chat_tokenizer(tmp_path / "tok")
    cfg = posttrain_config(
        chain="rm-ppo",
        sft={"steps": 3, "warmup_steps": 1, "num_examples": 64},
        rm={"steps": 3, "warmup_steps": 0, "num_examples": 32, "preference_pairs": 16},
        ppo={"steps": 2, "num_examples": 16, "prompts_per_step": 4, "samples_per_prompt": 2, "global_batch_size": 4,
             "micro_batch_size": 2, "minibatches": 2, "ppo_epochs": 2, "heldout_every": 1, "target_kl": 0.1,
             "lora": {"enabled": True, "r": 4}},  # rollouts then take the adapter alone
        task={"heldout_size": 8},
    )
    cfg.infra.workdir = str(tmp_path / "ws")
    ctx = StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out",
                       inputs={"pretrain": make_base(tmp_path / "pretrain", cfg, tok), "tokenizer": tok,
                               "tokens": make_tokens(tmp_path / "tokens", tok)},
                       log_metrics=lambda m, step=None: None)
    result = run(ctx)
    out = tmp_path / "out"
    assert list(result) == ["sft", "rm", "ppo"]
    rm = json.loads((out / "rm" / "posttrain.json").read_text())
    assert rm["pairs_n"] == 16 and 0 <= rm["pairwise_accuracy_after"] <= 1 and rm["pairwise_accuracy_after_se"] >= 0
    assert rm["pairwise_accuracy_z"] == pytest.approx((rm["pairwise_accuracy_after"] - 0.5) / rm["pairwise_accuracy_after_se"])
    assert rm["hf_architecture"] == "LlamaForSequenceClassification" and rm["hf_max_score_diff"] < 1e-4
    assert (out / "rm" / "hf" / "config.json").is_file()
    rm_metrics = [json.loads(x) for x in (out / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert {"preference_accuracy", "reward_margin"} <= set(rm_metrics[-1])

    ppo = json.loads((out / "ppo" / "posttrain.json").read_text())
    for k in ("heldout_accuracy_before", "heldout_accuracy_after", "heldout_reward_before", "heldout_reward_after",
              "heldout_reward_gain", "heldout_reward_gain_se", "train_kl", "train_value_loss"):
        assert k in ppo, k
    assert ppo["steps"] == 2 * 2 * 2  # rollout batches x epochs x minibatches
    rows = [json.loads(x) for x in (out / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    assert {"score", "kl", "kl_coef", "value_loss", "policy_loss", "clip_fraction", "approx_kl",
            "heldout_accuracy", "heldout_reward", "response_length"} <= set(rows[0])
    assert rows[0]["approx_kl"] == pytest.approx(0, abs=1e-6)  # the first minibatch is on-policy: ratio 1
    sd = load_full_state_dict(find_checkpoint(out / "ppo"))  # the policy alone, what export reads
    assert "layers.0.self_attn.q_proj.weight" in sd and not any(k.startswith(("policy.", "value.")) for k in sd)
    adapter = json.loads((out / "ppo" / "adapter" / "adapter_config.json").read_text())  # the policy's, in PEFT's format
    assert adapter["r"] == 4 and "q_proj" in adapter["target_modules"]
    assert rows[-1]["weight_push_s"] > 0  # the adapter went into the engine after each batch
    assert (out / "model.safetensors").is_file()
