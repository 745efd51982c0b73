"""Train one proxy as a trainer job through the configured launcher, cached by its own fingerprint.

A proxy is committed as the artifact `ablations/proxy/<fingerprint>` (the fingerprint hashes the proxy's
model, training section and seed, and the `tokens` fingerprint), with its figures in the manifest (a data
mixture is part of the training section, so it is hashed too). So a widened sweep trains only the new
points, and an interrupted sweep resumes where it stopped. Each trained proxy gets its own MLflow run
nested under the ablations stage's run: params, the trainer's loss curve (rank 0 logs into it) and the
final validation loss, side by side in the UI.

A run that ends `diverged` (a learning rate too high) is a result, not an error: it is committed with
an infinite loss so the fit skips it and the sweep does not retry it. A crash raises.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from infra.artifacts import MANIFEST, artifact_prefix, commit_artifact, find_artifact, fingerprint
from infra.config import LifecycleConfig
from infra.launch import get_launcher
from infra.launch.job import JobSpec
from infra.tracking import Tracker
from infra.workspace import Workspace

from ..job_tracking import job_tracking, replay_metrics
from .proxies import ProxyPoint, proxy_config, proxy_section

PROXY_STAGE = "ablations/proxy"


class ProxyJobFailed(RuntimeError):
    """A proxy's trainer job crashed (not a divergence); the message names its log."""


@dataclass(frozen=True)
class ProxyJob:
    """What every proxy of one stage call shares. Plain data, so a Prefect task can take it."""

    config: dict  # the resolved LifecycleConfig (model_dump)
    tokens_uri: str
    tokens_fingerprint: str
    parent_run_id: str | None = None  # the ablations stage's MLflow run
    concurrency: int = 1
    threads: int = 1  # OMP threads per CPU proxy job

    def lifecycle_config(self) -> LifecycleConfig:
        return LifecycleConfig.model_validate(self.config)


@dataclass
class ProxyResult:
    name: str
    fingerprint: str
    uri: str
    status: str  # completed | diverged
    val_loss: float  # inf when diverged
    loss: float  # last training loss
    cached: bool
    mlflow_run_id: str | None
    started: float
    ended: float
    point: dict

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def proxy(self) -> ProxyPoint:
        return ProxyPoint.from_dict(self.point)


# runner(job, points, done=None) -> results in the order of `points`; `done(result)` is called as each
# proxy finishes (the stage's progress bar), in whatever order they finish.
RunProxies = Callable[..., list[ProxyResult]]


def tokens_fingerprint(tokens_dir: Path, tokens_uri: str) -> str:
    """The committed tokens artifact's fingerprint (its manifest); an uncommitted folder (a notebook)
    is named by its URI."""
    manifest = Path(tokens_dir) / MANIFEST
    if manifest.is_file():
        fp = json.loads(manifest.read_text()).get("fingerprint")
        if fp:
            return fp
    return fingerprint("tokens-folder", {"uri": tokens_uri})


def proxy_fingerprint(cfg: LifecycleConfig, point: ProxyPoint, tokens_fp: str) -> str:
    return fingerprint(PROXY_STAGE, proxy_section(cfg, point), {"tokens": tokens_fp})


def _finite(x) -> float:
    return float(x) if x is not None and math.isfinite(float(x)) else math.inf


def _from_artifact(art, point: ProxyPoint, started: float) -> ProxyResult:
    s = art.manifest.get("summary") or {}
    return ProxyResult(name=point.name, fingerprint=art.fingerprint, uri=art.uri, status=s.get("status", "completed"),
                       val_loss=_finite(s.get("val_loss")), loss=_finite(s.get("loss")), cached=True,
                       mlflow_run_id=art.manifest.get("mlflow_run_id"), started=started, ended=time.time(),
                       point=point.as_dict())


def _log_tail(path: Path, lines: int = 20) -> str:
    if not path.exists():
        return ""
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def run_proxy(job: ProxyJob, point: ProxyPoint, log: Callable[[str], None] = print) -> ProxyResult:
    """Train `point` unless its artifact is committed; commit it; return its figures."""
    started = time.time()
    cfg = job.lifecycle_config()
    ws = Workspace.from_config(cfg)
    fp = proxy_fingerprint(cfg, point, job.tokens_fingerprint)
    existing = find_artifact(ws.store, ws.experiment, PROXY_STAGE, fp)
    if existing is not None:
        log(f"proxy {point.name}: cached {existing.uri}")
        return _from_artifact(existing, point, started)

    tracker = Tracker.for_workspace(ws)
    with tracker.run(f"proxy-{point.name}", parent_run_id=job.parent_run_id,
                     tags={"stage": PROXY_STAGE, "fingerprint": fp, "proxy.size": point.size}) as run_id:
        pcfg = proxy_config(cfg, point)
        out_dir = ws.path("staging", "ablations-proxy", fp)
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir(parents=True)
        prefix = artifact_prefix(ws.experiment, PROXY_STAGE, fp)
        ws.store.delete(prefix)  # a failed earlier attempt's output: proxies never resume
        job_id = f"proxy-{fp[:8]}-{uuid.uuid4().hex[:6]}"
        env = {} if cfg.infra.device == "cuda" else {"OMP_NUM_THREADS": str(job.threads)}
        spec = JobSpec(
            job_id=job_id, stage=PROXY_STAGE, section="pretrain", config=pcfg.model_dump(mode="json"),
            inputs={"tokens": job.tokens_uri}, output=ws.store.url(prefix), workdir=str(ws.path("jobs", job_id)),
            tracking=job_tracking(pcfg, ws.tracking_uri, ws.experiment, run_id), resume="none", env=env,
        )
        tracker.log_params(run_id, {"proxy": {**point.axes, "size": point.size, "params": point.params,
                                              "tokens": point.tokens, "flops": point.flops, "steps": point.train["steps"],
                                              "data_mixture": point.train.get("data_mixture")},
                                    "model": point.model})
        log(f"proxy {point.name}: training ({point.train['steps']} steps, N={point.params}, D={point.tokens})")
        launcher = get_launcher(pcfg)
        handle = launcher.submit(spec, spec.write(Path(spec.workdir) / "job.yaml"))
        try:
            code = handle.wait()
        except BaseException:  # Ctrl-C or a cancelled task: the proxy job must not outlive it
            handle.cancel()
            raise
        result = launcher.result(spec)
        replay_metrics(spec, lambda m, step: tracker.log_metrics(run_id, m, step=step))
        if result is not None and result.status == "diverged":
            status, val_loss = "diverged", math.inf
        elif code != 0 or result is None or result.status != "completed":
            raise ProxyJobFailed(
                f"proxy {point.name} (job {job_id}) ended with exit code {code} "
                f"({result.status + ': ' + result.message if result else 'no result.json'}); log: {handle.log_path}\n"
                f"--- last lines ---\n{_log_tail(handle.log_path)}"
            )
        else:
            status, val_loss = "completed", _finite(result.metrics.get("val_loss"))
        loss = _finite(result.metrics.get("loss"))
        summary = {"status": status, "val_loss": val_loss if math.isfinite(val_loss) else None,
                   "loss": loss if math.isfinite(loss) else None, "steps": result.steps, "params": point.params,
                   "tokens": point.tokens, "flops": point.flops, **point.axes}
        tracker.log_metrics(run_id, {k: v for k, v in (("final_val_loss", val_loss), ("final_loss", loss))
                                     if math.isfinite(v)})
        tracker.set_tags(run_id, {"proxy.status": status})
        ws.store.delete(f"{prefix}/checkpoints")  # proxies are measured, never resumed from
        art = commit_artifact(ws.store, ws.experiment, PROXY_STAGE, fp, out_dir, config=proxy_section(cfg, point),
                              with_store_files=True,  # what the job wrote to the store
                              inputs={"tokens": job.tokens_fingerprint}, started_at=started,
                              extra={"summary": summary, "mlflow_run_id": run_id, "point": point.as_dict()})
        tracker.set_tags(run_id, {"artifact_uri": art.uri})
    shutil.rmtree(out_dir, ignore_errors=True)
    log(f"proxy {point.name}: {status}, val_loss={val_loss:.4f}")
    return ProxyResult(name=point.name, fingerprint=fp, uri=art.uri, status=status, val_loss=val_loss, loss=loss,
                       cached=False, mlflow_run_id=run_id, started=started, ended=time.time(), point=point.as_dict())


def run_proxies_sequential(job: ProxyJob, points: list[ProxyPoint], log: Callable[[str], None] = print,
                           done: Callable[[ProxyResult], None] | None = None) -> list[ProxyResult]:
    """The default runner (a notebook, a test): one proxy after the other in this process."""
    results = []
    for p in points:
        results.append(run_proxy(job, p, log))
        if done is not None:
            done(results[-1])
    return results


def default_concurrency(cfg: LifecycleConfig) -> int:
    """Proxies at once: `ablations.concurrency`, else the CPU cores over the threads each job takes
    (one at a time on a GPU machine, where a proxy has the device to itself)."""
    a = cfg.ablations
    if a.concurrency:
        return a.concurrency
    if cfg.infra.device == "cuda":
        return 1
    if cfg.infra.device == "auto":
        import torch

        if torch.cuda.is_available():
            return 1
    return max(1, (os.cpu_count() or 1) // a.threads_per_proxy)
