"""`eightfold compare RUN_A RUN_B`: two lifecycle runs side by side, read from MLflow.

A run is named by its MLflow run id, the Prefect flow-run id it is tagged with, or its run name.
What differs in the config comes from the parent runs' params (the flattened config); the figures
come from each stage's MLflow run, read generically (whatever metrics the stage logged: final loss,
eval table cells, serving latency...). A stage that was a cache hit in a lifecycle run has a nested
run there tagged `cached` (a copy of the builder's final figures, infra.tracking.Tracker.cached_stage_run);
the parent's `stage.<name>.fingerprint` tag leads to the run that made that artifact, whose figures and
nested runs (evaluate's variants) are shown, marked cached. Older lifecycle runs, with no nested run
for a cache hit, read the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlparse

from rich.console import Console
from rich.table import Table

from infra.tracking import ui_url

FLOW_RUN_TAG = "prefect.flow_run_id"
PARENT_TAG = "mlflow.parentRunId"


class RunNotFound(LookupError):
    pass


@dataclass
class RunView:
    """One side of a comparison: the parent run and, per stage, the metrics of the run that made it."""

    run_id: str
    name: str
    status: str
    params: dict[str, str]
    stages: dict[str, dict] = field(default_factory=dict)  # label -> {run_id, status, metrics}


@dataclass
class Comparison:
    a: RunView
    b: RunView
    param_diff: dict[str, tuple[str | None, str | None]]
    metrics: dict[str, dict[str, tuple[float | None, float | None]]]  # stage label -> metric -> (a, b)
    experiment_ids: list[str]


def _experiment_ids(client, experiment: str | None) -> list[str]:
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is not None:
            return [exp.experiment_id]
    return [e.experiment_id for e in client.search_experiments()]


def _quote(value: str) -> str:
    return "'" + value.replace("'", "\\'") + "'"


def resolve_run(client, ident: str, experiment: str | None = None):
    """An MLflow run from a run id, a Prefect flow-run id (the latest parent tagged with it: a retried
    flow run has one parent per attempt) or a run name (`lifecycle-<prefect run name>` too)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(ident)
    except MlflowException:
        pass
    tried = ["MLflow run id"]
    for ids in (_experiment_ids(client, experiment), _experiment_ids(client, None)):
        for what, flt in (
            ("Prefect flow-run id", f"tags.`{FLOW_RUN_TAG}` = {_quote(ident)}"),
            ("run name", f"attributes.run_name = {_quote(ident)}"),
            ("run name", f"attributes.run_name = {_quote('lifecycle-' + ident)}"),
        ):
            runs = client.search_runs(ids, flt, order_by=["attributes.start_time DESC"], max_results=1)
            if runs:
                return runs[0]
            tried.append(what)
    where = f"experiment {experiment!r} or any other" if experiment else "any experiment"
    raise RunNotFound(f"no MLflow run {ident!r} in {where} (tried: {', '.join(dict.fromkeys(tried))})")


def _numeric(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _stage_runs(client, parent) -> dict[str, object]:
    """stage -> the MLflow run holding its figures for this lifecycle run."""
    ids = [parent.info.experiment_id]
    found: dict[str, object] = {}
    children = client.search_runs(ids, f"tags.`{PARENT_TAG}` = {_quote(parent.info.run_id)}",
                                  order_by=["attributes.start_time ASC"])
    # later attempts (a retried task) replace earlier ones; a finished run wins. A cache hit's run carries
    # no `fingerprint` tag, so below it gives way to the run that built the artifact (when it is there).
    for run in children:
        stage = run.data.tags.get("stage") or run.info.run_name
        if stage not in found or run.info.status == "FINISHED" or found[stage].info.status != "FINISHED":
            found[stage] = run
    tags = parent.data.tags
    for key, fp in tags.items():
        if not (key.startswith("stage.") and key.endswith(".fingerprint")):
            continue
        stage = key[len("stage."):-len(".fingerprint")]
        if stage in found and found[stage].data.tags.get("fingerprint") == fp and found[stage].info.status == "FINISHED":
            continue
        made = client.search_runs(
            ids, f"tags.stage = {_quote(stage)} and tags.fingerprint = {_quote(fp)} and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=1)
        if made:
            found[stage] = made[0]
    return found


def _view(client, run) -> RunView:
    view = RunView(run.info.run_id, run.info.run_name, run.info.status, dict(run.data.params))
    stages = _stage_runs(client, run)
    if not stages and run.data.tags.get("stage"):  # a stage run given directly
        stages = {run.data.tags["stage"]: run}
    for stage, srun in stages.items():
        cached = run.data.tags.get(f"stage.{stage}.status") == "cached" or srun.data.tags.get("cached") == "true"
        view.stages[stage] = {"run_id": srun.info.run_id, "status": srun.info.status, "cached": cached,
                              "metrics": _numeric(srun.data.metrics)}
        # Nested runs under a stage run (evaluate: one per model variant) are rows of their own.
        for sub in client.search_runs([srun.info.experiment_id], f"tags.`{PARENT_TAG}` = {_quote(srun.info.run_id)}",
                                      order_by=["attributes.start_time ASC"]):
            label = f"{stage}/{sub.data.tags.get('variant') or sub.info.run_name}"
            view.stages[label] = {"run_id": sub.info.run_id, "status": sub.info.status, "cached": False,
                                  "metrics": _numeric(sub.data.metrics)}
    return view


def compare_runs(tracking_uri: str, run_a: str, run_b: str, experiment: str | None = None) -> Comparison:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    ra, rb = resolve_run(client, run_a, experiment), resolve_run(client, run_b, experiment)
    a, b = _view(client, ra), _view(client, rb)
    keys = sorted(set(a.params) | set(b.params))
    diff = {k: (a.params.get(k), b.params.get(k)) for k in keys if a.params.get(k) != b.params.get(k)}
    metrics: dict[str, dict] = {}
    order = list(a.stages) + [s for s in b.stages if s not in a.stages]
    for stage in order:
        ma = a.stages.get(stage, {}).get("metrics", {})
        mb = b.stages.get(stage, {}).get("metrics", {})
        metrics[stage] = {k: (ma.get(k), mb.get(k)) for k in sorted(set(ma) | set(mb))}
    return Comparison(a, b, diff, metrics, sorted({ra.info.experiment_id, rb.info.experiment_id}))


def ui_link(tracking_uri: str, comp: Comparison) -> str:
    """MLflow's compare-runs page for the two runs (served by `mlflow ui` for a local database)."""
    frag = (f"#/compare-runs?runs={quote(json.dumps([comp.a.run_id, comp.b.run_id]))}"
            f"&experiments={quote(json.dumps(comp.experiment_ids))}")
    if urlparse(tracking_uri).scheme in ("http", "https"):
        return ui_url(tracking_uri, frag)
    return f"mlflow ui --backend-store-uri {tracking_uri}   then open {ui_url('http://127.0.0.1:5000', frag)}"


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if math.isfinite(v) and v == int(v) and abs(v) < 1e12:
        return str(int(v))
    return f"{v:.5g}"


def _delta(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == b:
        return "" if a == b else "n/a"
    rel = f" ({(b - a) / abs(a):+.1%})" if a else ""
    return f"{b - a:+.4g}{rel}"


def print_comparison(comp: Comparison, tracking_uri: str, console: Console | None = None) -> None:
    console = console or Console(soft_wrap=True)
    head = Table(title="runs")
    for col in ("", "A", "B"):
        head.add_column(col, overflow="fold")
    head.add_row("name", comp.a.name, comp.b.name)
    head.add_row("run id", comp.a.run_id, comp.b.run_id)
    head.add_row("status", comp.a.status, comp.b.status)
    console.print(head)

    if comp.param_diff:
        params = Table(title=f"config values that differ ({len(comp.param_diff)})")
        for col in ("param", "A", "B"):
            params.add_column(col, overflow="fold")
        for k, (va, vb) in comp.param_diff.items():
            params.add_row(k, "-" if va is None else va, "-" if vb is None else vb)
        console.print(params)
    else:
        console.print("config: identical")

    figures = Table(title="metrics per stage (the stage run's last value)")
    for col in ("stage", "metric", "A", "B", "B - A"):
        figures.add_column(col, overflow="fold")
    for stage, rows in comp.metrics.items():
        marks = "".join(f" [{side}: cached]" for side, v in (("A", comp.a), ("B", comp.b))
                        if v.stages.get(stage, {}).get("cached"))
        for i, (k, (va, vb)) in enumerate(rows.items()):
            figures.add_row(stage + marks if i == 0 else "", k, _fmt(va), _fmt(vb), _delta(va, vb))
        if not rows:
            figures.add_row(stage + marks, "(no metrics)", "", "", "")
    console.print(figures)
    console.print(f"MLflow UI: {ui_link(tracking_uri, comp)}")


def compare_command(run_a: str, run_b: str, config: str | None = None, overrides: list[str] | None = None) -> int:
    """Print what differs between two lifecycle runs; 2 when a run cannot be found."""
    from infra.config import ConfigError, load_config
    from infra.workspace import Workspace

    err = Console(stderr=True, soft_wrap=True)
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    ws = Workspace.from_config(cfg)
    if ws.tracking_uri.startswith("sqlite:///") and not Path(ws.tracking_uri[len("sqlite:///"):]).is_file():
        err.print(f"[red]no MLflow database at {ws.tracking_uri}: run `eightfold run` first, or pass the config "
                  "(--config) or MLFLOW_TRACKING_URI that names where the runs are[/red]")
        return 2
    try:
        comp = compare_runs(ws.tracking_uri, run_a, run_b, ws.experiment)
    except RunNotFound as exc:
        err.print(f"[red]{exc}[/red] (tracking URI {ws.tracking_uri})")
        return 2
    print_comparison(comp, ws.tracking_uri)
    return 0
