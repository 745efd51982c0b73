"""Post-training steps as stage functions. Each step:
  1. loads the upstream model (pretrain's checkpoint, or the previous step's model.safetensors) through
     stages.export.merge (whatever mesh it was saved on),
  2. scores held-out accuracy and held-out pretraining perplexity (the tokens artifact's val split) before,
  3. writes its training data (user jsonl, or built in from the task family's train split) into
     data/train.jsonl of its own artifact,
  4. launches a trainer job (section posttrain.<step>) with the configured launcher, like pretrain; SFT
     mixes `sft.replay_fraction` of pretraining rows into its batches,
  5. scores both again after (DPO also preference accuracy before/after, PPO the reward model's score of the
     held-out answers before/after), logs all of it, and fails when the perplexity rose past
     `posttrain.max_heldout_ppl_ratio` times the pretrained model's.
The reward model (posttrain-rm, reward_model.py) is not a language model and is measured its own way.

Why a registry stage per step (posttrain-sft -> posttrain-dpo -> posttrain-grpo, posttrain-sft ->
posttrain-rm -> posttrain-ppo) rather than one stage with sub-steps: each step is then its own
content-addressed artifact (changing GRPO's settings re-runs only GRPO), and `eightfold stage posttrain-grpo`
runs from the latest committed DPO artifact. A step with `enabled: false` passes its input model through, so
the chain stays the same shape. `run(ctx)` runs posttrain.chain's steps in sub-folders of one output (a
notebook's one call)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

from infra.launch.job import JobSpec
from infra.store import open_uri

from ..base import StageContext
from ..export.merge import find_checkpoint, load_full_state_dict
from ..job_tracking import fetch_output_file, job_tracking, replay_metrics
from ..pretrain import launch_and_wait
from .accuracy import heldout_accuracy, heldout_reward, load_reward_weights, outcome_bits, paired_change, preference_accuracy
from .data import builtin_rows, grpo_rows, heldout, write_jsonl
from .perplexity import LanguageModelLost, heldout_perplexity, heldout_rows, pretrained_perplexity

UPSTREAM = {"sft": "pretrain", "dpo": "posttrain-sft", "grpo": "posttrain-dpo", "ppo": "posttrain-sft"}
EXTRA_INPUTS = {"ppo": ("posttrain-rm",)}  # PPO's reward model (and its critic's start)


def load_upstream(folder: Path) -> dict:
    """The one place post-training reads a model: any checkpoint folder the export stage can read."""
    return load_full_state_dict(find_checkpoint(folder))


def _save(sd: dict, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})
    return path


def _training_rows(ctx: StageContext, step: str) -> list[dict]:
    sc = getattr(ctx.cfg.posttrain, step)
    if sc.data:
        from trainer.posttrain_data import read_jsonl

        return read_jsonl(sc.data)
    seed = sc.seed if sc.seed is not None else ctx.cfg.seed
    return builtin_rows(step, ctx.cfg.posttrain.task, sc.num_examples, seed)


def _job_inputs_prefix(ctx: StageContext, job_id: str) -> str:
    return f"{ctx.workspace.experiment}/jobs/{job_id}"


def _job_inputs(ctx: StageContext, job_id: str, base: Path, data: Path,
                extra: dict[str, Path] | None = None) -> dict[str, str]:
    """URIs of the job's inputs. Outside a task, this machine's folders. In a task, store URIs only, so
    the job's nodes need no path of this machine: the base weights (merged here from the upstream
    checkpoint) and any `extra` folder (PPO's reward model) go to the store beside the job, the training
    data into the artifact itself, and the tokenizer and replay rows are the committed artifacts'."""
    extra = extra or {}
    if ctx.out_uri is None:
        return {"base": str(base.resolve()), "tokenizer": str(Path(ctx.inputs["tokenizer"]).resolve()),
                "data": str(data.resolve()), "replay": str((Path(ctx.inputs["tokens"]) / "train").resolve()),
                **{k: str(v.resolve()) for k, v in extra.items()}}
    store = ctx.workspace.store
    prefix = _job_inputs_prefix(ctx, job_id)
    for name, folder in {"base": base, **extra}.items():
        store.put_dir(folder, f"{prefix}/{name}")
    data_uri = ctx.job_output("data")
    data_store, data_key = open_uri(data_uri, ctx.workspace.s3_endpoint_url)
    data_store.put_dir(data, data_key)
    return {"base": store.url(f"{prefix}/base"), "tokenizer": ctx.input_uris["tokenizer"], "data": data_uri,
            "replay": f"{ctx.input_uris['tokens'].rstrip('/')}/train", **{k: store.url(f"{prefix}/{k}") for k in extra}}


def _drop_job_inputs(ctx: StageContext, job_id: str) -> None:
    if ctx.out_uri is not None:
        ctx.workspace.store.delete(_job_inputs_prefix(ctx, job_id))


def train_job(ctx: StageContext, step: str, sd: dict, scratch: Path,
              extra: dict[str, Path] | None = None) -> tuple[Any, Path]:
    """Launch the step's trainer job on `sd` and the data in out_dir/data/ (plus `extra` input folders), wait
    for it, replay its metrics when its nodes could not log them, and fetch its model.safetensors:
    (the job's result, that file here)."""
    cfg = ctx.cfg
    base = _save(sd, scratch / "base" / "model.safetensors").parent
    spec = JobSpec(
        job_id=scratch.name, stage=f"posttrain/{step}", section=f"posttrain.{step}",
        config=cfg.model_dump(mode="json"),
        inputs=_job_inputs(ctx, scratch.name, base, Path(ctx.out_dir) / "data", extra),
        output=ctx.job_output(), workdir=str(scratch),
        tracking=job_tracking(cfg, ctx.workspace.tracking_uri, ctx.workspace.experiment, ctx.run_id),
        resume="none",
    )
    try:
        result = launch_and_wait(ctx, spec)
    finally:
        _drop_job_inputs(ctx, scratch.name)
    replay_metrics(spec, ctx.log_metrics)  # when the job's nodes could not reach the tracking store
    model = fetch_output_file(spec, "model.safetensors")
    if model is None:
        raise FileNotFoundError(f"posttrain-{step}: job {spec.job_id} completed but {spec.output} has no "
                                "model.safetensors")
    return result, model


def run_step(ctx: StageContext, step: str) -> dict[str, Any]:
    cfg, pc = ctx.cfg, ctx.cfg.posttrain
    sc = getattr(pc, step)
    upstream = UPSTREAM[step]
    needed = (upstream, *EXTRA_INPUTS.get(step, ()), "tokenizer", "tokens")
    if any(name not in ctx.inputs for name in needed):
        raise ValueError(f"posttrain-{step} needs inputs {', '.join(map(repr, needed))}; got {sorted(ctx.inputs)}")
    tok_dir = Path(ctx.inputs["tokenizer"])
    out = Path(ctx.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    scratch = ctx.workspace.path("jobs", f"posttrain-{step}-{uuid.uuid4().hex[:8]}")
    sd = load_upstream(Path(ctx.inputs[upstream]))
    before = heldout_accuracy(sd, cfg.model, tok_dir, pc.task, scratch / "eval-before", cfg.seed)
    summary: dict[str, Any] = {"step": step, "heldout_n": before["n"], **_scored("heldout_accuracy", before, "before")}
    ppl_rows = heldout_rows(Path(ctx.inputs["tokens"]), pc.heldout_ppl_rows)
    ppl_before = heldout_perplexity(sd, cfg.model, ppl_rows)
    summary.update(heldout_ppl_before=ppl_before, heldout_ppl_rows=int(ppl_rows.shape[0]),
                   heldout_ppl_pretrained=pretrained_perplexity(Path(ctx.inputs[upstream]), ppl_before))
    pref_before = None
    if step == "dpo":
        pref_before = preference_accuracy(sd, cfg.model, tok_dir, pc.task, sc.preference_pairs, cfg.seed)
        summary.update(preference_pairs_n=pref_before["n"], **_scored("preference_accuracy", pref_before, "before"))
    rm_sd = reward_before = None
    if step == "ppo":  # the reward model's score of the greedy answers, before and after
        rm_sd = load_reward_weights(Path(ctx.inputs["posttrain-rm"]))
        reward_before = heldout_reward(rm_sd, cfg.model, tok_dir, pc.task, before["texts"], cfg.seed)
    after, pref_after, reward_after = before, pref_before, reward_before
    if not sc.enabled:
        _save(sd, out / "model.safetensors")
        summary.update(enabled=False)
    else:
        write_jsonl(_training_rows(ctx, step), out / "data" / "train.jsonl")
        extra = {}
        if step == "ppo":  # the held-out prompts the job scores as it trains, and the reward model's weights
            write_jsonl(grpo_rows(heldout(pc.task, cfg.seed)), out / "data" / "heldout.jsonl")
            extra["reward"] = _save(rm_sd, scratch / "reward" / "model.safetensors").parent
        result, model = train_job(ctx, step, sd, scratch, extra)
        sd = load_upstream(model.parent)
        after = heldout_accuracy(sd, cfg.model, tok_dir, pc.task, scratch / "eval-after", cfg.seed)
        summary.update({"steps": result.steps, "samples_after": after["samples"],
                        **{f"train_{k}": v for k, v in result.metrics.items()}})
        if step == "dpo":
            pref_after = preference_accuracy(sd, cfg.model, tok_dir, pc.task, sc.preference_pairs, cfg.seed)
        if step == "ppo":
            reward_after = heldout_reward(rm_sd, cfg.model, tok_dir, pc.task, after["texts"], cfg.seed)
    summary.update(_scored("heldout_accuracy", after, "after"))
    if reward_before is not None:
        summary.update(heldout_reward_before=reward_before["mean"], heldout_reward_before_se=reward_before["se"],
                       heldout_reward_after=reward_after["mean"], heldout_reward_after_se=reward_after["se"],
                       **_change("heldout_reward", reward_before["scores"], reward_after["scores"]))
    ppl_after = heldout_perplexity(sd, cfg.model, ppl_rows) if sc.enabled else ppl_before
    summary.update(heldout_ppl_after=ppl_after, heldout_ppl_ratio=ppl_after / summary["heldout_ppl_pretrained"],
                   max_heldout_ppl_ratio=pc.max_heldout_ppl_ratio)
    summary.update(_change("heldout_accuracy", before["correct"], after["correct"]))
    if pref_before is not None:
        summary.update(_scored("preference_accuracy", pref_after, "after"))
        summary.update(_change("preference_accuracy", pref_before["wins"], pref_after["wins"]))
    shutil.rmtree(scratch, ignore_errors=True)
    (out / "posttrain.json").write_text(json.dumps(summary, indent=2))
    ctx.log_metrics({k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
                    None)
    limit = pc.max_heldout_ppl_ratio
    if limit is not None and not summary["heldout_ppl_ratio"] <= limit:
        raise LanguageModelLost(
            f"posttrain-{step}: held-out pretraining perplexity {ppl_after:.4g} is {summary['heldout_ppl_ratio']:.3f}x "
            f"the pretrained model's {summary['heldout_ppl_pretrained']:.4g} (posttrain.max_heldout_ppl_ratio {limit}): "
            "the step unlearned the language model; lower its lr or steps, or raise sft.replay_fraction")
    return {k: v for k, v in summary.items() if k != "samples_after" and not k.endswith("_outcomes")}


def _scored(name: str, m: dict, when: str) -> dict[str, Any]:
    """An accuracy with its binomial standard error, count and per-item outcomes (to pair steps later)."""
    outcomes = m["correct"] if "correct" in m else m["wins"]
    return {f"{name}_{when}": m["accuracy"], f"{name}_{when}_se": m["se"], f"{name}_{when}_count": sum(outcomes),
            f"{name}_{when}_outcomes": outcome_bits(outcomes)}


def _change(name: str, before: list[bool], after: list[bool]) -> dict[str, float]:
    """after - before on the same items and its paired standard error (the noise a real gain must clear)."""
    gain, se = paired_change(before, after)
    return {f"{name}_gain": gain, f"{name}_gain_se": se}


def run_sft(ctx: StageContext) -> dict[str, Any]:
    return run_step(ctx, "sft")


def run_dpo(ctx: StageContext) -> dict[str, Any]:
    return run_step(ctx, "dpo")


def run_grpo(ctx: StageContext) -> dict[str, Any]:
    return run_step(ctx, "grpo")


def run_ppo(ctx: StageContext) -> dict[str, Any]:
    return run_step(ctx, "ppo")


def run(ctx: StageContext) -> dict[str, Any]:
    """posttrain.chain's steps in order into out_dir/<step>/ from inputs `pretrain`, `tokenizer` and `tokens`; the
    last language model is also copied to out_dir/model.safetensors (what export reads)."""
    from .reward_model import run_rm

    results: dict[str, Any] = {}
    inputs = dict(ctx.inputs)
    for step in ctx.cfg.posttrain.steps:
        sub = dataclasses.replace(ctx, out_dir=Path(ctx.out_dir) / step, inputs=dict(inputs), out_uri=None)
        results[step] = run_rm(sub) if step == "rm" else run_step(sub, step)
        inputs[f"posttrain-{step}"] = Path(ctx.out_dir) / step
    last = [s for s in ctx.cfg.posttrain.steps if s != "rm"][-1]
    shutil.copy2(Path(ctx.out_dir) / last / "model.safetensors", Path(ctx.out_dir) / "model.safetensors")
    return results
