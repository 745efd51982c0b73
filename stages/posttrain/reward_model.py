"""`posttrain-rm`: the reward model of classic RLHF (seed: "trains a reward model on pairs of responses that
people ranked"). From the SFT model's weights, a trainer job fits the scalar head and the trunk with the
Bradley-Terry loss on the pairs DPO uses (trainer/objectives/reward.py). The stage then:
  - measures held-out pairwise accuracy (how often the right answer to a held-out problem scores above a near
    miss) with its binomial standard error and its distance from chance in standard errors, beside the SFT
    model's own log-likelihood ranking of the same pairs;
  - exports it as a Hugging Face sequence-classification checkpoint (hf/, LlamaForSequenceClassification) and
    checks that transformers scores held-out sequences as we do;
  - fails when `posttrain.rm.min_accuracy_z` is set and the accuracy is not that many standard errors above
    chance (a reward model no better than a coin would steer PPO nowhere).
Artifact: model.safetensors (the trunk as `trunk.*` and `score.weight`: what PPO loads), hf/, data/,
posttrain.json, the job's metrics.jsonl and result.json."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from ..base import StageContext
from ..export import hf as hf_layout
from .accuracy import heldout_pairs, load_reward_weights, pairwise_accuracy, preference_accuracy, reward_model
from .stage import _scored, _training_rows, load_upstream, train_job
from .data import write_jsonl


class RewardModelNoBetterThanChance(RuntimeError):
    pass


@torch.no_grad()
def hf_score_diff(sd: dict[str, torch.Tensor], folder: Path, cfg, tokenizer_dir: Path, task, seed: int,
                  rows: int = 16) -> float:
    """Largest |our score - transformers' score| over `rows` held-out sequences (right-padded, attention
    mask), read from the exported folder by AutoModelForSequenceClassification."""
    from transformers import AutoModelForSequenceClassification

    from trainer import posttrain_data as pdata

    tok = pdata.load_tokenizer(tokenizer_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    seqs = [ids for pair in heldout_pairs(tok, task, rows // 2, seed) for ids, _ in pair]
    ids = torch.full((len(seqs), max(map(len, seqs))), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    ours = reward_model(sd, cfg)(ids, mask.sum(1) - 1)
    hf = AutoModelForSequenceClassification.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    theirs = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    return float((ours - theirs).abs().max())


def run_rm(ctx: StageContext) -> dict[str, Any]:
    cfg, pc = ctx.cfg, ctx.cfg.posttrain
    rc = pc.rm
    if any(name not in ctx.inputs for name in ("posttrain-sft", "tokenizer", "tokens")):
        raise ValueError(f"posttrain-rm needs inputs 'posttrain-sft', 'tokenizer' and 'tokens'; got {sorted(ctx.inputs)}")
    if not rc.enabled:
        raise ValueError("posttrain.rm.enabled is false, but PPO needs a reward model: drop rm-ppo from posttrain.chain")
    tok_dir = Path(ctx.inputs["tokenizer"])
    out = Path(ctx.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scratch = ctx.workspace.path("jobs", f"posttrain-rm-{uuid.uuid4().hex[:8]}")
    sd = load_upstream(Path(ctx.inputs["posttrain-sft"]))
    sft_ranking = preference_accuracy(sd, cfg.model, tok_dir, pc.task, rc.preference_pairs, cfg.seed)
    write_jsonl(_training_rows(ctx, "rm"), out / "data" / "train.jsonl")
    result, model = train_job(ctx, "rm", sd, scratch)
    rm_sd = load_reward_weights(model)
    if model.resolve() != (out / "model.safetensors").resolve():
        shutil.copy2(model, out / "model.safetensors")
    acc = pairwise_accuracy(rm_sd, cfg.model, tok_dir, pc.task, rc.preference_pairs, cfg.seed)
    z = (acc["accuracy"] - 0.5) / max(acc["se"], 1e-12)
    trunk = {k.removeprefix("trunk."): v for k, v in rm_sd.items() if k.startswith("trunk.")}
    export = hf_layout.write_reward_hf(trunk, rm_sd["score.weight"], cfg.model, out / "hf", dtype="float32",
                                       tokenizer_dir=tok_dir)
    diff = hf_score_diff(rm_sd, out / "hf", cfg.model, tok_dir, pc.task, cfg.seed)
    summary: dict[str, Any] = {
        "step": "rm", "steps": result.steps, **{f"train_{k}": v for k, v in result.metrics.items()},
        "pairs_n": acc["n"], **_scored("pairwise_accuracy", acc, "after"), "pairwise_accuracy_z": z,
        "pairwise_margin": acc["margin"], "min_accuracy_z": rc.min_accuracy_z,
        # the SFT model's own ranking of the same pairs by log-likelihood, what the head starts from
        **_scored("sft_preference_accuracy", sft_ranking, "before"),
        "hf_architecture": export["architecture"], "hf_max_score_diff": diff,
    }
    shutil.rmtree(scratch, ignore_errors=True)
    (out / "posttrain.json").write_text(json.dumps(summary, indent=2))
    ctx.log_metrics({k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
                    None)
    if diff > 1e-3:
        raise RuntimeError(f"posttrain-rm: transformers scores the export {diff:.3g} away from the trained model")
    if rc.min_accuracy_z is not None and not z > rc.min_accuracy_z:
        raise RewardModelNoBetterThanChance(
            f"posttrain-rm: held-out pairwise accuracy {acc['accuracy']:.3f} +- {acc['se']:.3f} ({acc['n']} pairs) is "
            f"{z:.2f} standard errors above chance, not more than posttrain.rm.min_accuracy_z = {rc.min_accuracy_z}")
    return {k: v for k, v in summary.items() if not k.endswith("_outcomes")}
