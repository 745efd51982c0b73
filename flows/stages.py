"""One Prefect flow per stage, so each can be deployed, scheduled and triggered alone (from the UI,
`prefect deployment run`, or `eightfold stage NAME`). Each runs on the latest committed upstream
artifacts unless `inputs` pins them by fingerprint."""

from __future__ import annotations

from prefect import flow

from flows.lifecycle import run_single_stage
from stages.registry import STAGES


def _stage_flow(stage: str):
    @flow(name=f"stage-{stage}", log_prints=True)
    def run_stage(
        config: str = "configs/tiny.yaml",
        overrides: list[str] | None = None,
        inputs: dict[str, str] | None = None,
        force: bool = False,
    ) -> dict:
        return run_single_stage(stage, config, overrides, inputs, force)

    run_stage.__doc__ = f"Run the {stage!r} stage alone on the latest committed upstream artifacts."
    return run_stage


STAGE_FLOWS = {name: _stage_flow(name) for name in STAGES}
# Module attributes so deployments have an entrypoint: flows/stages.py:<stage>_flow
globals().update({f"{name}_flow": f for name, f in STAGE_FLOWS.items()})
