"""Proxy runs as Prefect tasks: each proxy is one task run (named after the proxy, so the UI lists
the sweep), submitted to a ThreadPoolTaskRunner whose `max_workers` is the sweep's concurrency. Each
task launches its trainer job and waits on it, so at most that many jobs train at once; the cache is
the proxy's committed artifact (stages/ablations/runner.py), not Prefect's result cache.

Importing this module installs the runner into the ablations stage (flows/lifecycle.py does), so the
lifecycle and `eightfold stage ablations` map proxies concurrently while a notebook calling
`stages.ablations.stage.run(ctx)` trains them one after the other.
"""

from __future__ import annotations

import math
from typing import Callable

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from stages.ablations.proxies import ProxyPoint
from stages.ablations.runner import ProxyJob, ProxyResult, run_proxy
from stages.ablations.stage import use_proxy_runner


@task(name="proxy", cache_policy=NO_CACHE, retries=0)
def proxy_task(job: ProxyJob, point: dict) -> dict:
    logger = get_run_logger()
    return run_proxy(job, ProxyPoint.from_dict(point), log=logger.info).as_dict()


def run_proxies_prefect(job: ProxyJob, points: list[ProxyPoint],
                        done: Callable[[ProxyResult], None] | None = None) -> list[ProxyResult]:
    """Every proxy as a task, `job.concurrency` at a time; results in the order of `points`, `done`
    called as each task finishes."""
    with ThreadPoolTaskRunner(max_workers=job.concurrency) as runner:
        futures = [runner.submit(proxy_task.with_options(task_run_name=f"proxy-{p.name}"),
                                 {"job": job, "point": p.as_dict()}) for p in points]
        for finished in as_completed(futures):
            result = ProxyResult(**finished.result())  # a failed proxy raises as soon as it ends
            if done is not None:
                done(result)
        return [ProxyResult(**f.result()) for f in futures]


def log_prediction(tracker, parent_run_id: str, summary: dict | None) -> dict[str, float]:
    """After pretrain: predicted vs actual final validation loss into the lifecycle's parent run."""
    summary = summary or {}
    pred, actual = summary.get("predicted_val_loss"), summary.get("val_loss")
    if pred is None or actual is None:
        return {}
    figures = {"pretrain.val_loss": float(actual), "ablations.predicted_val_loss": float(pred),
               "ablations.prediction_error": (float(pred) - float(actual)) / float(actual)}
    std = summary.get("predicted_val_loss_std")
    if std is not None and math.isfinite(std):
        figures["ablations.predicted_val_loss_std"] = float(std)
    tracker.log_metrics(parent_run_id, figures)
    return figures


use_proxy_runner(run_proxies_prefect)
