"""The lifecycle flow: the seed's stages in the order a person would explain them.

data -> tokenizer -> (pack tokens) -> ablations -> pretrain -> post-train -> export -> evaluate -> serve.
Each stage is a task that skips itself when its artifact is committed (fingerprint cache), runs in an
MLflow run nested under this flow's parent run, and publishes a Prefect markdown artifact.
"""

from __future__ import annotations

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from infra.config import load_config
from infra.tracking import Tracker, flatten_params
from infra.workspace import Workspace
from stages.registry import STAGES, downstream, in_chain, stage_inputs, stage_order
from tasks.ablations import log_prediction  # also installs the Prefect proxy runner for the ablations stage
from tasks.health import health_task
from tasks.stage import ArtifactRef, is_committed, resolve_upstream, submit_stage


# stages that load the model as a Hugging Face checkpoint: every one after pretraining (post-training's
# engine writes one for rollouts and held-out accuracy; the rest read the export)
NEEDS_HF = downstream("pretrain") - {"pretrain"}


def check_runnable(cfg, selected: list[str]) -> None:
    """Refuse, before anything runs, what a later stage would refuse after hours of training."""
    from stages.export.hf import hf_export_problem

    later = [s for s in selected if s in NEEDS_HF]
    problem = hf_export_problem(cfg.model, cfg.export.moe_architecture) if later else None
    if problem:
        raise ValueError(f"{problem} (stages {', '.join(later)} need the model as a Hugging Face checkpoint; "
                         "run up to pretrain with --stages, or change the model)")


@flow(name="lifecycle", log_prints=True)
def lifecycle(
    config: str = "configs/tiny.yaml",
    overrides: list[str] | None = None,
    stages: list[str] | None = None,
    force: list[str] | None = None,
) -> dict[str, dict]:
    """Run the lifecycle on CONFIG. `stages` limits which run (upstream artifacts must exist);
    `force` re-runs the named stages and everything downstream of them."""
    logger = get_run_logger()
    cfg = load_config(config, overrides or [])
    ws = Workspace.from_config(cfg)
    # a post-training step off posttrain.chain's branches does not run, even when named
    selected = [s for s in stage_order(stages) if in_chain(cfg, s)]
    check_runnable(cfg, selected)
    forced = set().union(*(downstream(s) for s in (force or []))) if force else set()

    tracker = Tracker.for_workspace(ws)
    refs: dict[str, ArtifactRef] = {}
    with tracker.run(
        f"lifecycle-{flow_run.get_name() or 'local'}",
        tags={"prefect.flow_run_id": str(flow_run.get_id() or ""), "config": str(config), "kind": "lifecycle"},
    ) as parent:
        tracker.log_params(parent, flatten_params(cfg.model_dump(mode="json")))
        for stage in selected:
            spec = STAGES[stage]
            names = stage_inputs(cfg, stage)
            if any(i not in refs for i in names):  # upstream not selected: use its latest artifact
                refs.update({k: v for k, v in resolve_upstream(cfg, stage).items() if k not in refs})
            inputs = {name: refs[name] for name in names}
            # a cache hit needs no healthy machine (and only training stages ask)
            if spec.trains and cfg.infra.health_check and (stage in forced or not is_committed(cfg, stage, inputs)):
                health_task(config, overrides or [])
            refs[stage] = submit_stage(cfg, stage, inputs, parent_run_id=parent, force=stage in forced)
            # Which artifact each stage used, cached or not: what `eightfold compare` and the report read.
            tracker.set_tags(parent, {f"stage.{stage}.fingerprint": refs[stage].fingerprint,
                                      f"stage.{stage}.status": "cached" if refs[stage].cached else "ran"})
            if stage == "pretrain":
                log_prediction(tracker, parent, refs[stage].summary)  # predicted vs actual final val loss
    logger.info("lifecycle finished: %s", ", ".join(f"{k}={'cached' if v.cached else 'ran'}" for k, v in refs.items()))
    return {k: v.__dict__ for k, v in refs.items()}


def run_single_stage(
    stage: str,
    config: str = "configs/tiny.yaml",
    overrides: list[str] | None = None,
    inputs: dict[str, str] | None = None,
    force: bool = False,
) -> dict:
    """One stage on the latest committed upstream artifacts (or those pinned by fingerprint).
    Called inside a flow: flows/stages.py gives each stage its own."""
    cfg = load_config(config, overrides or [])
    ws = Workspace.from_config(cfg)
    stage_order([stage])
    upstream = resolve_upstream(cfg, stage, inputs)
    if STAGES[stage].trains and cfg.infra.health_check and (force or not is_committed(cfg, stage, upstream)):
        health_task(config, overrides or [])
    tracker = Tracker.for_workspace(ws)
    with tracker.run(f"stage-{stage}", tags={"prefect.flow_run_id": str(flow_run.get_id() or ""), "kind": "stage"}) as parent:
        ref = submit_stage(cfg, stage, upstream, parent_run_id=parent, force=force)
    return ref.__dict__
