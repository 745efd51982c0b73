"""The sweep's progress bar: one tick per proxy as it finishes. Proxies here are stand-ins that return
a loss from a known surface at once (no trainer job), so the stage runs in seconds; the real sweep
(test_ablations_sweep.py) draws the same bar through Prefect."""

import math
import threading

import pytest

import stages.ablations.runner as runner_module
import stages.ablations.stage as stage_module
from fixtures.progress import final
from infra.config import load_config
from infra.workspace import Workspace
from stages.ablations.proxies import ProxyPoint, plan_sweep
from stages.ablations.runner import ProxyJob, ProxyResult, run_proxies_sequential
from stages.base import StageContext


def config(tmp):
    cfg = load_config("tiny")
    cfg.infra.workdir = str(tmp / "ws")
    cfg.ablations = cfg.ablations.model_validate({**cfg.ablations.model_dump(), "sweep": {"lr": [1e-3, 3e-3, 1e-2]}})
    return cfg


def stand_in(point: ProxyPoint) -> ProxyResult:
    """L(C) = 60 C^-0.16 + 1.9 plus a parabola in log lr around 3e-3."""
    loss = 60.0 * point.flops**-0.16 + 1.9 + 0.05 * (math.log(point.axes["lr"]) - math.log(3e-3)) ** 2
    return ProxyResult(name=point.name, fingerprint="0" * 16, uri="", status="completed", val_loss=loss, loss=loss,
                       cached=False, mlflow_run_id=None, started=0.0, ended=1.0, point=point.as_dict())


def test_stage_bar_ticks_once_per_proxy_finished(tmp_path, capsys, monkeypatch):
    cfg = config(tmp_path)
    points = plan_sweep(cfg)
    bars = []
    real_bar = stage_module.progress_bar

    def keep(*args, **kwargs):
        bars.append(real_bar(*args, **kwargs))
        return bars[-1]

    seen_done = []  # the bar's count as each proxy starts: the ones before it, finished

    def proxy(job, point, log=print):
        seen_done.append(bars[0].n)
        return stand_in(point)

    monkeypatch.setattr(stage_module, "progress_bar", keep)
    monkeypatch.setattr(runner_module, "run_proxy", proxy)
    (tmp_path / "tokens").mkdir()
    ctx = StageContext(cfg, Workspace.from_config(cfg), tmp_path / "out", inputs={"tokens": tmp_path / "tokens"})
    summary = stage_module.run(ctx, run_proxies=run_proxies_sequential, log=lambda _m: None)
    assert summary["proxies"] == len(points) > 3
    assert seen_done == list(range(len(points)))
    bar = final(capsys.readouterr().err, "ablations")
    assert (bar.percent, bar.n, bar.total, bar.unit) == (100, str(len(points)), str(len(points)), "proxy")


def test_prefect_runner_reports_each_proxy_as_it_ends(tmp_path, prefect_harness, monkeypatch):
    import tasks.ablations as prefect_runner

    cfg = config(tmp_path)
    points = plan_sweep(cfg)[:3]
    first_two_reported = threading.Event()
    waited = {}

    def proxy(job, point, log=print):
        if point.name == points[2].name:  # the last one ends only once the others have been counted
            waited["in_time"] = first_two_reported.wait(timeout=60)
        return stand_in(point)

    done = []

    def on_done(result):
        done.append(result.name)
        if len(done) == 2:
            first_two_reported.set()

    monkeypatch.setattr(prefect_runner, "run_proxy", proxy)
    job = ProxyJob(config=cfg.model_dump(mode="json"), tokens_uri="unused", tokens_fingerprint="0" * 16,
                   concurrency=3)
    results = prefect_runner.run_proxies_prefect(job, points, done=on_done)
    assert waited == {"in_time": True}  # counted while the third was still running, not at the end
    assert done[-1] == points[2].name and sorted(done) == sorted(p.name for p in points)
    assert [r.name for r in results] == [p.name for p in points]  # in the order of the points


@pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs")  # a task outside a flow
def test_prefect_runner_raises_the_first_proxy_that_fails(tmp_path, prefect_harness, monkeypatch):
    import tasks.ablations as prefect_runner

    cfg = config(tmp_path)
    points = plan_sweep(cfg)[:2]

    def proxy(job, point, log=print):
        if point.name == points[1].name:
            raise runner_module.ProxyJobFailed(f"proxy {point.name} crashed")
        return stand_in(point)

    monkeypatch.setattr(prefect_runner, "run_proxy", proxy)
    job = ProxyJob(config=cfg.model_dump(mode="json"), tokens_uri="unused", tokens_fingerprint="0" * 16,
                   concurrency=2)
    with pytest.raises(runner_module.ProxyJobFailed, match=points[1].name):
        prefect_runner.run_proxies_prefect(job, points, done=lambda _r: None)
