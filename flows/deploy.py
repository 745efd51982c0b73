"""Deployments: the lifecycle on a schedule and one deployment per stage, on a Prefect work pool.

`eightfold deploy` registers them against the Prefect API in `PREFECT_API_URL` (a team server, see
README "Team set-up"): it creates the work pool when missing and calls
`flow.from_source(<project root>, entrypoint).deploy(...)` for each flow. On a `process` pool nothing
is built or pushed: the worker runs the flows from this checkout (its pull step changes into the
project root). On a `kubernetes` pool the flow runs in `--image`, which must hold the project.

The deployment list comes from the stage registry, so a new stage gets its deployment for free;
`prefect.yaml` (for `prefect deploy --all`) is rendered from the same list by `python -m flows.deploy`
and a test keeps the two equal.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from stages.registry import STAGES

ROOT = Path(__file__).resolve().parents[1]
PROCESS_POOL = "eightfold-process"
KUBERNETES_POOL = "eightfold-kubernetes"
NIGHTLY = "0 2 * * *"  # 02:00 UTC: the lifecycle re-runs nightly; finished stages are cache hits
DEFAULT_CONFIG = "configs/tiny.yaml"


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment: which flow (entrypoint), its default parameters and whether it is scheduled."""

    flow_name: str  # the @flow name, first half of `prefect deployment run FLOW/DEPLOYMENT`
    # A module path (flows.stages.data_flow), not a file path (flows/stages.py:data_flow): loading a
    # file puts its folder first on sys.path, where flows/stages.py would shadow the `stages` package.
    entrypoint: str
    description: str
    scheduled: bool = False
    parameters: dict = field(default_factory=dict)


def deployment_specs(config: str = DEFAULT_CONFIG, overrides: list[str] | None = None) -> list[DeploymentSpec]:
    """The lifecycle (scheduled) and one per stage in the registry (triggered by hand or by API)."""
    params = {"config": config, "overrides": list(overrides or [])}
    specs = [DeploymentSpec("lifecycle", "flows.lifecycle.lifecycle",
                            "All stages in order; finished stages are cache hits.", True, params)]
    for name in STAGES:
        specs.append(DeploymentSpec(f"stage-{name}", f"flows.stages.{name}_flow",
                                    f"The {name!r} stage alone, on the latest committed upstream artifacts.",
                                    False, params))
    return specs


def _ensure_pool(client, pool: str, pool_type: str | None, console: Console) -> str:
    """The pool's type; the pool is created (process unless named like a Kubernetes pool) if missing.
    A worker started on the same pool at the same moment creates it too: whichever comes second reads
    the pool the other made."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        existing = client.read_work_pool(pool)
    except ObjectNotFound:
        new_type = pool_type or ("kubernetes" if "kubernetes" in pool else "process")
        template = _default_template(new_type)
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type=new_type, base_job_template=template or {}))
        except ObjectAlreadyExists:
            existing = client.read_work_pool(pool)
        else:
            console.print(f"created work pool [bold]{pool}[/bold] (type {new_type})")
            return new_type
    if pool_type and existing.type != pool_type:
        raise ValueError(f"work pool {pool!r} exists with type {existing.type!r}, not {pool_type!r}")
    return existing.type


def _default_template(pool_type: str) -> dict | None:
    """The worker type's default job template (what `prefect work-pool create --type T` uses)."""
    from prefect.utilities.asyncutils import run_coro_as_sync
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    template = run_coro_as_sync(get_default_base_job_template_for_infrastructure_type(pool_type))
    if template is None:
        raise ValueError(f"no default job template for work pool type {pool_type!r} (is its worker package installed?)")
    return template


def register(
    pool: str = PROCESS_POOL,
    cron: str | None = NIGHTLY,
    config: str = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    pool_type: str | None = None,
    image: str | None = None,
    source: str | None = None,
    env: dict[str, str] | None = None,
    console: Console | None = None,
) -> dict[str, str]:
    """Create the pool if missing and register every deployment; returns {"flow/deployment": id}."""
    from prefect import Flow
    from prefect.client.orchestration import get_client

    console = console or Console(stderr=True)
    if cron is not None and len(cron.split()) not in (5, 6):
        raise ValueError(f"cron {cron!r}: expected 5 fields like '0 2 * * *' (minute hour day month weekday)")
    with get_client(sync_client=True) as client:
        kind = _ensure_pool(client, pool, pool_type, console)
    if kind == "kubernetes" and not image:
        raise ValueError(f"work pool {pool!r} is a Kubernetes pool: pass --image (an image holding this project)")
    job_variables: dict = {"env": dict(env)} if env else {}
    if image:
        job_variables["image"] = image
    ids = {}
    for spec in deployment_specs(config, overrides):
        flow = Flow.from_source(source=source or str(ROOT), entrypoint=spec.entrypoint)
        dep_id = flow.deploy(
            name=pool,
            work_pool_name=pool,
            build=False,
            push=False,
            cron=cron if spec.scheduled and cron else None,
            parameters=spec.parameters,
            job_variables=job_variables or None,
            description=spec.description,
            tags=["eightfold"],
            print_next_steps=False,
            ignore_warnings=True,
        )
        ids[f"{spec.flow_name}/{pool}"] = str(dep_id)
    return ids


def deploy_command(
    pool: str = PROCESS_POOL,
    cron: str | None = NIGHTLY,
    config: str | None = None,
    overrides: list[str] | None = None,
    image: str | None = None,
    source: str | None = None,
) -> int:
    """`eightfold deploy`: register the deployments on PREFECT_API_URL and say how to run them."""
    from rich.table import Table

    console = Console(stderr=True, soft_wrap=True)
    api = os.environ.get("PREFECT_API_URL")
    if not api:
        from prefect.settings import PREFECT_API_URL

        api = PREFECT_API_URL.value()
    if not api:
        console.print("[red]PREFECT_API_URL is not set: start a server (`prefect server start`) and "
                      "`export PREFECT_API_URL=http://127.0.0.1:4200/api`, or point it at your team's server[/red]")
        return 2
    if cron is not None and cron.strip().lower() in ("", "none", "off"):
        cron = None
    config = config or DEFAULT_CONFIG
    if Path(config).is_file() and Path(config).resolve().is_relative_to(ROOT):
        config = str(Path(config).resolve().relative_to(ROOT))  # the worker runs in the project root
    try:
        ids = register(pool, cron, config, overrides, image=image, source=source, console=console)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    table = Table(title=f"deployments on {api}")
    for col in ("deployment", "schedule", "id"):
        table.add_column(col, overflow="fold")
    for name, dep_id in ids.items():
        table.add_row(name, (f"cron {cron} (UTC)" if cron else "none") if name.startswith("lifecycle/") else "manual", dep_id)
    Console(soft_wrap=True).print(table)
    console.print(f"config {config!r}; a worker runs them: [bold]prefect worker start --pool {pool}[/bold]")
    console.print(f"trigger one: prefect deployment run 'lifecycle/{pool}'   or   "
                  f"prefect deployment run 'stage-pretrain/{pool}' --param config={config}")
    return 0


def render_prefect_yaml(config: str = DEFAULT_CONFIG, cron: str = NIGHTLY) -> str:
    """prefect.yaml for `prefect deploy --all` from the project root: the same deployments on the
    process pool, and the scheduled lifecycle on the Kubernetes pool (image from $EIGHTFOLD_IMAGE)."""
    specs = deployment_specs(config)
    lines = [
        "# Rendered by `python -m flows.deploy > prefect.yaml` from stages/registry.py; tests check it.",
        "# `eightfold deploy` registers the same deployments without this file (README: Team set-up).",
        "# `prefect deploy --all` from the project root: the pull step runs flows from this checkout.",
        "name: eightfold",
        "prefect-version: 3.9.1",
        "",
        "build: null",
        "push: null",
        "pull:",
        "  - prefect.deployments.steps.set_working_directory:",
        "      directory: \"{{ $PWD }}\"",
        "",
        "definitions:",
        "  work_pools:",
        f"    process: &process {{name: {PROCESS_POOL}, work_queue_name: default}}",
        f"    kubernetes: &kubernetes {{name: {KUBERNETES_POOL}, work_queue_name: default,"
        " job_variables: {image: \"{{ $EIGHTFOLD_IMAGE }}\"}}",
        "  schedules:",
        f"    nightly: &nightly {{cron: \"{cron}\", timezone: UTC, active: true}}",
        "",
        "deployments:",
    ]

    def block(spec: DeploymentSpec, pool: str, alias: str, schedule: bool) -> list[str]:
        out = [
            f"  - name: {pool}",
            f"    entrypoint: {spec.entrypoint}",
            f"    description: \"{spec.description}\"",
            "    tags: [eightfold]",
            f"    parameters: {{config: {spec.parameters['config']}}}",
            f"    work_pool: *{alias}",
            "    schedules: [*nightly]" if schedule else "    schedules: []",
        ]
        return out

    for spec in specs:
        lines += block(spec, PROCESS_POOL, "process", spec.scheduled)
    lines += block(specs[0], KUBERNETES_POOL, "kubernetes", True)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_prefect_yaml(), end="")
