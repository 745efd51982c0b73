"""The pre-flight health check as a Prefect task: it runs before every training job."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from infra.config import load_config
from infra.workspace import Workspace


class HealthCheckFailed(RuntimeError):
    pass


@task(name="health-check", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def health_task(config: str, overrides: list[str]) -> dict:
    from infra.health import run_health

    cfg = load_config(config, overrides)
    report = run_health(cfg, Workspace.from_config(cfg))
    rows = "\n".join(f"| {c.name} | {'ok' if c.ok else 'FAILED'} | {c.detail} |" for c in report.checks)
    create_markdown_artifact(markdown=f"## health\n\n| check | status | detail |\n|---|---|---|\n{rows}",
                             key=f"{cfg.name}-health".lower(), description="pre-flight health check")
    failed = [c for c in report.checks if not c.ok]
    if failed:
        raise HealthCheckFailed("health check failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    get_run_logger().info("health ok: %s", ", ".join(c.name for c in report.checks))
    return {c.name: c.ok for c in report.checks}
