"""The lifecycle refuses, before anything runs, a model that a later stage could not load: post-training,
export, evaluate and serve need it as a Hugging Face checkpoint (flows/lifecycle.check_runnable)."""

from __future__ import annotations

import pytest

from flows.lifecycle import check_runnable
from infra.config import load_config
from stages.registry import stage_order

MOE = "model.moe={num_experts: 4, top_k: 1, balance: %s}"


def test_a_model_no_hugging_face_architecture_holds_is_refused_before_pretraining():
    cfg = load_config("tiny", [MOE % "bias"])
    with pytest.raises(ValueError, match=r"balance=bias.*posttrain-sft, posttrain-dpo, posttrain-grpo, posttrain-rm, posttrain-ppo, export"):
        check_runnable(cfg, stage_order(None))
    check_runnable(cfg, stage_order(["data", "tokenizer", "tokens", "pretrain"]))  # pretraining alone is fine
    check_runnable(load_config("tiny", [MOE % "aux_loss"]), stage_order(None))
    check_runnable(load_config("tiny"), stage_order(None))
    both = load_config("tiny", ["model.qk_norm=true", "model.moe={num_experts: 4, top_k: 1, shared_expert: true}"])
    with pytest.raises(ValueError, match="QK-norm and a shared expert"):
        check_runnable(both, ["export"])
