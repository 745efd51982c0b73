"""The stage graph: what each stage runs, which artifacts it reads, and which config it depends on.

Prefect-free, so a notebook can walk it too. The fingerprint of a stage hashes `section(cfg)` and
its inputs' fingerprints (infra/artifacts.py); `fn` is imported lazily so listing stages is cheap.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from infra.config import LifecycleConfig


@dataclass(frozen=True)
class StageSpec:
    name: str
    fn: str  # "module:function", called with a stages.base.StageContext
    inputs: tuple[str, ...]
    section: Callable[[LifecycleConfig], Any]
    trains: bool = False  # launches a distributed training job (health check first, retries)
    lifecycle_stage: str = ""  # which of the seed's eight stages this step belongs to

    def load(self) -> Callable:
        module, func = self.fn.split(":")
        return getattr(importlib.import_module(module), func)


def _dump(obj: Any) -> Any:
    return obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj


def _data_section(cfg: LifecycleConfig) -> dict:
    """The data stage also depends on the evaluation sets it decontaminates against."""
    from stages.data import eval_texts_digest
    from stages.evaluate.decontam import register as register_eval_sets

    register_eval_sets()
    data = _dump(cfg.data)
    # Where and how widely the pipeline runs does not change what it writes (tasks are cut by data.task_mb):
    # switching executors or worker counts is a cache hit.
    for key in ("executor", "workers", "ray_address", "slurm"):
        data.pop(key, None)
    return {"data": data, "eval_texts": eval_texts_digest(cfg)}


STAGES: dict[str, StageSpec] = {
    s.name: s
    for s in [
        StageSpec("data", "stages.data:run_clean", (), _data_section, lifecycle_stage="data"),
        StageSpec("tokenizer", "stages.tokenizer:run", ("data",), lambda c: _dump(c.tokenizer), lifecycle_stage="tokenizer"),
        StageSpec(
            "tokens",
            "stages.data:run_pack",
            ("data", "tokenizer"),
            # layout: the train split is laid out source by source with row ranges in index.json (mixtures)
            lambda c: {"seq_len": c.pretrain.seq_len, "sources": _dump(c.data.sources), "seed": c.data.seed,
                       "shard_mb": c.data.shard_mb, "layout": "source-rows"},
            lifecycle_stage="data",
        ),
        StageSpec(
            "ablations",
            "stages.ablations.stage:run",
            ("tokens",),
            lambda c: {"seed": c.seed, "model": _dump(c.model), "pretrain": _dump(c.pretrain),
                       "ablations": _dump(c.ablations), "device": c.infra.device},
            lifecycle_stage="ablations",
        ),
        StageSpec(
            "pretrain",
            "stages.pretrain:run",
            ("tokens", "ablations"),
            lambda c: {"seed": c.seed, "model": _dump(c.model), "parallel": _dump(c.parallel), "pretrain": _dump(c.pretrain)},
            trains=True,
            lifecycle_stage="pretrain",
        ),
        # post-training: a step per artifact, each reading the one before it (stages/posttrain/stage.py); two
        # branches from SFT, of which posttrain.chain picks one or both (chain_stages)
        *[
            StageSpec(
                f"posttrain-{step}",
                fn,
                (*upstream, "tokenizer", "tokens"),  # tokens: held-out perplexity, SFT's replayed pretraining rows
                lambda c, step=step: {"seed": c.seed, "model": _dump(c.model), "parallel": _dump(c.parallel),
                                      "task": _dump(c.posttrain.task), step: _dump(getattr(c.posttrain, step)),
                                      "heldout_ppl_rows": c.posttrain.heldout_ppl_rows,
                                      "max_heldout_ppl_ratio": c.posttrain.max_heldout_ppl_ratio},
                trains=True,
                lifecycle_stage="posttrain",
            )
            for step, upstream, fn in (
                ("sft", ("pretrain",), "stages.posttrain.stage:run_sft"),
                ("dpo", ("posttrain-sft",), "stages.posttrain.stage:run_dpo"),
                ("grpo", ("posttrain-dpo",), "stages.posttrain.stage:run_grpo"),
                ("rm", ("posttrain-sft",), "stages.posttrain.reward_model:run_rm"),
                ("ppo", ("posttrain-sft", "posttrain-rm"), "stages.posttrain.stage:run_ppo"),
            )
        ],
        StageSpec(
            "export",
            "stages.export.stage:run",
            # every model of the chain's branches: export.source picks what ships, export.lineage exports the rest
            ("pretrain", "posttrain-sft", "posttrain-dpo", "posttrain-grpo", "posttrain-ppo", "tokenizer", "tokens"),
            # posttrain.task: the held-out conversations chat models are checked on
            lambda c: {"model": _dump(c.model), "export": _dump(c.export), "task": _dump(c.posttrain.task), "seed": c.seed},
            lifecycle_stage="export",
        ),
        StageSpec(
            "evaluate",
            "stages.evaluate.stage:run",
            ("export", "data"),
            lambda c: {"evaluate": _dump(c.evaluate)},
            lifecycle_stage="evaluate",
        ),
        StageSpec("serve", "stages.serve.stage:run", ("export",), lambda c: _dump(c.serve), lifecycle_stage="serve"),
    ]
}


def in_chain(cfg: LifecycleConfig, stage: str) -> bool:
    """Whether `posttrain.chain` runs this stage: a post-training step off the chain's branches does not."""
    if not stage.startswith("posttrain-"):
        return True
    return stage.removeprefix("posttrain-") in cfg.posttrain.steps


def stage_inputs(cfg: LifecycleConfig, stage: str) -> tuple[str, ...]:
    """The stage's inputs that this config runs (export reads the models of the chain's branches only)."""
    return tuple(i for i in STAGES[stage].inputs if in_chain(cfg, i))


def stage_order(selected: list[str] | None = None) -> list[str]:
    """Stages in dependency order (registry order is already topological)."""
    names = list(STAGES)
    if not selected:
        return names
    unknown = [s for s in selected if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; known: {', '.join(names)}")
    return [n for n in names if n in selected]


def downstream(stage: str) -> set[str]:
    """The stage and everything that (transitively) reads it."""
    out = {stage}
    changed = True
    while changed:
        changed = False
        for s in STAGES.values():
            if s.name not in out and out.intersection(s.inputs):
                out.add(s.name)
                changed = True
    return out
