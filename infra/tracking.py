"""MLflow tracking through `MlflowClient` with explicit run ids.

No global active run: a Prefect task, a stage function and trainer rank 0 in another process all
log into the same run by passing its id around. The experiment is the config `name`; a lifecycle
run is a parent run (tagged with the Prefect flow run id) and each stage is a nested run under it
(tag `mlflow.parentRunId`, the tag MLflow's own UI uses to draw the tree), tagged with its stage and
fingerprint. Params come flattened from the config; metrics are per step.

A stage that is a cache hit in a lifecycle run still gets a nested run there (`cached_stage_run`),
so MLflow's compare view of two lifecycle runs has a column for every stage. It is tagged
`cached=true` and carries the fingerprint as `cached_fingerprint`, never as `fingerprint`: the
`fingerprint` tag means "this run built that artifact", and every search for a builder
(`tags.fingerprint = ...`) keeps finding only builders without having to know about cached runs (a
`tags.cached != 'true'` filter would not do: MLflow drops runs that lack the tag from such a match).

Each checkpoint a training job commits becomes one of MLflow 3's LoggedModels (`RunLogger.
log_checkpoint_model`): an external model (the weights stay in the object store) whose source is the
stage's run, with the step's training metrics linked to it.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping
from urllib.parse import urlparse

log = logging.getLogger(__name__)

# MLflow's own limits (mlflow.utils.validation): param values and keys are capped, and one
# log_batch call takes at most 1000 metrics and 100 params.
MAX_PARAM_VALUE = 6000
MAX_KEY = 250
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_PER_BATCH = 100

PARENT_TAG = "mlflow.parentRunId"
FLOW_RUN_TAG = "prefect.flow_run_id"
# What MLflow 3 reads to tell a training experiment from a GenAI one (its UI, the API's users).
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
# MLflow 3.17's UI picks its GenAI or training view from the browser's last choice (GenAI at first),
# not from the experiment's kind; a link that names the training view opens there.
TRAINING_VIEW = "workflowType=machine_learning"
NOTE_TAG = "mlflow.note.content"  # the run's description in MLflow's UI
CACHED_TAG = "cached"
CACHED_FINGERPRINT_TAG = "cached_fingerprint"
BUILT_BY_TAG = "built_by_run_id"
BUILT_BY_URL_TAG = "built_by_run_url"
SYSTEM_METRICS_PREFIX = "system/"  # MLflow's system metrics: the builder's machine, not the stage's result
CHECKPOINT_MODEL_TYPE = "checkpoint"
RECENT_VALUES = 256  # per metric: a checkpoint commits some steps after its own, in the background


def flatten_params(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """{'model': {'dim': 128}} -> {'model.dim': '128'}; lists as JSON; values cut to MLflow's limit."""
    out: dict[str, str] = {}
    for key, value in d.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten_params(value, name))
            continue
        if isinstance(value, (list, tuple, dict)):
            text = json.dumps(value, default=str, separators=(",", ":"))
        else:
            text = str(value)
        out[name[:MAX_KEY]] = text[:MAX_PARAM_VALUE]
    return out


def _now_ms() -> int:
    return int(time.time() * 1000)


def _as_float(value: Any) -> float:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metric value {value!r} is not a number") from exc


def ui_url(server: str, fragment: str) -> str:
    """A page of a tracking server's UI (`fragment`: its hash route, e.g. `#/experiments/1`), opened in
    the training view."""
    sep = "&" if "?" in fragment else "?"
    return f"{server.rstrip('/')}/{fragment}{sep}{TRAINING_VIEW}"


def default_artifact_location(tracking_uri: str) -> str | None:
    """Where run artifacts go when nobody says: next to a sqlite database (never MLflow's ./mlruns
    in the current directory); for a server, None lets the server decide (its proxied store)."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme == "sqlite":
        db = Path(tracking_uri[len("sqlite:///"):])
        return (db.parent / "mlflow-artifacts").resolve().as_uri()
    if parsed.scheme in ("", "file"):
        return (Path(parsed.path).resolve().parent / "mlflow-artifacts").as_uri()
    return None


def mlflow_client(uri: str, registry_uri: str | None = None):
    """An MlflowClient for `uri`: a sqlite file's folder made, its schema-migration notices and MLflow's
    per-run link printing quieted."""
    from mlflow import MlflowClient  # imported late: ~1.5 s, and health checks want to time it

    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        # a new database announces its schema migration at INFO on every first run: not ours to print
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    # MLflow prints two links (to its GenAI view) per run it ends on a server, after one more request for the
    # run: noise in every stage's log. Our links (`run_url`, Prefect's link artifacts) open the training view.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    return MlflowClient(tracking_uri=uri, registry_uri=registry_uri)


class Tracker:
    """One experiment on one tracking server; every call names its run id explicitly."""

    def __init__(self, uri: str, experiment: str, artifact_location: str | None = None):
        if not experiment:
            raise ValueError("Tracker needs an experiment name (the config's `name`)")
        self.uri = uri
        self.experiment = experiment
        if artifact_location is None:
            artifact_location = default_artifact_location(uri)
        elif "://" not in artifact_location:  # a plain path: make it absolute, never cwd-relative
            artifact_location = Path(artifact_location).expanduser().resolve().as_uri()
        self.artifact_location = artifact_location
        self.client = mlflow_client(uri)
        self.experiment_id = self._get_or_create_experiment()

    @classmethod
    def for_workspace(cls, workspace) -> "Tracker":
        """The workspace's experiment; local databases keep artifacts in `<workdir>/mlflow-artifacts`."""
        location = None
        if urlparse(workspace.tracking_uri).scheme in ("sqlite", "", "file"):
            location = workspace.mlflow_artifacts.as_uri()
        return cls(workspace.tracking_uri, workspace.experiment, location)

    def _get_or_create_experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                return self.client.create_experiment(self.experiment, artifact_location=self.artifact_location,
                                                     tags=dict([EXPERIMENT_KIND]))
            except MlflowException:
                # Another process (a second rank, a parallel task) created it between our two calls.
                exp = self.client.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        if exp.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:  # made by an older eightfold or by hand
            self.client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
        return exp.experiment_id

    # --- runs ------------------------------------------------------------------------------------
    def start_run(self, name: str, parent_run_id: str | None = None, tags: Mapping[str, Any] | None = None) -> str:
        all_tags = {"mlflow.user": _user(), "mlflow.source.name": "eightfold"}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        all_tags.update({k: str(v) for k, v in (tags or {}).items() if v is not None})
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        allowed = ("FINISHED", "FAILED", "KILLED")
        if status not in allowed:
            raise ValueError(f"run status {status!r}: allowed {', '.join(allowed)}")
        self.client.set_terminated(run_id, status=status)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_table(self, run_id: str, data: Mapping[str, list], artifact_file: str) -> None:
        """A table MLflow's UI shows as one (the run's artifacts, and the Evaluation view)."""
        self.client.log_table(run_id, data=dict(data), artifact_file=artifact_file)

    def log_figure(self, run_id: str, figure: Any, artifact_file: str) -> None:
        self.client.log_figure(run_id, figure, artifact_file)

    def log_artifact_inputs(self, run_id: str, inputs: Mapping[str, tuple[str, str]], context: str = "training") -> None:
        """The artifacts a stage read, as MLflow dataset inputs (name -> (uri, fingerprint)): the run's
        Datasets panel names each with its digest and source, and runs that read the same one match."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        source_type = lambda uri: "s3" if uri.startswith("s3://") else "local"  # noqa: E731
        datasets = [DatasetInput(Dataset(name=name, digest=fp, source_type=source_type(uri),
                                         source=json.dumps({"uri": uri})),
                                 tags=[InputTag("mlflow.data.context", context)])
                    for name, (uri, fp) in sorted(inputs.items())]
        if datasets:
            self.client.log_inputs(run_id, datasets=datasets)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Nested dicts are flattened; logging the same key twice with a different value is an error
        in MLflow (params are immutable), the same value is fine (a retried task)."""
        from mlflow.entities import Param

        flat = flatten_params(params)
        items = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])

    def log_metrics(self, run_id: str, metrics: Mapping[str, Any], step: int | None = None) -> None:
        _log_metric_batch(self.client, run_id, [(k, _as_float(v), step or 0, _now_ms()) for k, v in metrics.items()])

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"artifact {path} does not exist")
        if path.is_dir():
            self.client.log_artifacts(run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(run_id, str(path), artifact_path)

    def log_text(self, run_id: str, text: str, file_name: str) -> None:
        self.client.log_text(run_id, text, file_name)

    def cached_stage_run(self, stage: str, fingerprint: str, parent_run_id: str, built_by_run_id: str | None,
                         artifact_uri: str) -> str:
        """A cache hit's nested run under this lifecycle run, FINISHED at once: tagged `cached=true`,
        `cached_fingerprint` (not `fingerprint`: see the module docstring) and the run that built the
        artifact (its id, and its page when tracking is a server), with that run's params and the final
        value of each of its metrics at the step it was logged. A builder run that cannot be read (a
        tracking database started afresh under an old store) leaves the links and a warning, no copy."""
        tags = {"stage": stage, CACHED_TAG: "true", CACHED_FINGERPRINT_TAG: fingerprint, "artifact_uri": artifact_uri,
                NOTE_TAG: f"Cache hit: {stage} {fingerprint} was built earlier"
                          + (f" by run {built_by_run_id}" if built_by_run_id else "") + f"; artifact {artifact_uri}"}
        built = None
        if built_by_run_id:
            tags[BUILT_BY_TAG] = built_by_run_id
            if urlparse(self.uri).scheme in ("http", "https"):
                tags[BUILT_BY_URL_TAG] = self.run_url(built_by_run_id)
            try:
                built = self.client.get_run(built_by_run_id)
            except Exception as exc:  # noqa: BLE001 - the cached run still says where the artifact came from
                log.warning("%s: the run %s that built %s cannot be read (%s): its metrics are not copied",
                            stage, built_by_run_id, fingerprint, exc)
        with self.run(f"{stage}-{fingerprint[:8]}-cached", parent_run_id, tags) as run_id:
            if built is not None:
                if built.data.params:
                    self.log_params(run_id, built.data.params)
                # the latest value of each metric at its own step: RunData keeps the Metric objects, its
                # public `metrics` only the values (step 0 then, should a later MLflow drop the objects)
                latest = [(m.key, m.value, m.step, m.timestamp) for m in getattr(built.data, "_metric_objs", [])] \
                    or [(k, v, 0, _now_ms()) for k, v in built.data.metrics.items()]
                _log_metric_batch(self.client, run_id, [r for r in latest if not r[0].startswith(SYSTEM_METRICS_PREFIX)])
        return run_id

    def run_url(self, run_id: str) -> str:
        """Where a person looks: the UI page for a server, the run id and `mlflow ui` for a file."""
        if urlparse(self.uri).scheme in ("http", "https"):
            return ui_url(self.uri, f"#/experiments/{self.experiment_id}/runs/{run_id}")
        return f"run {run_id} in {self.uri} (mlflow ui --backend-store-uri {self.uri})"

    # --- context managers ------------------------------------------------------------------------
    @contextmanager
    def run(self, name: str, parent_run_id: str | None = None, tags: Mapping[str, Any] | None = None) -> Iterator[str]:
        """A run that always ends: FINISHED when the body returns, KILLED on Ctrl-C, FAILED on any
        other exception, wherever it is raised (so no run a stage, flow or sweep opens stays RUNNING)."""
        run_id = self.start_run(name, parent_run_id, tags)
        try:
            yield run_id
        except KeyboardInterrupt:
            self.end_run(run_id, "KILLED")
            raise
        except BaseException:
            self.end_run(run_id, "FAILED")
            raise
        self.end_run(run_id, "FINISHED")

    @contextmanager
    def lifecycle_run(
        self, name: str, tags: Mapping[str, Any] | None = None, flow_run_id: str | None = None
    ) -> Iterator[str]:
        """The parent run of one lifecycle; FAILED when the body raises, KILLED on Ctrl-C."""
        tags = dict(tags or {})
        if flow_run_id:
            tags[FLOW_RUN_TAG] = flow_run_id
        with self.run(name, tags=tags) as run_id:
            yield run_id

    @contextmanager
    def stage_run(
        self,
        stage: str,
        fingerprint: str,
        parent_run_id: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> Iterator[str]:
        """A nested run for one stage under the lifecycle run, tagged with stage and fingerprint."""
        with self.run(stage, parent_run_id, {"stage": stage, "fingerprint": fingerprint, **(tags or {})}) as run_id:
            if params:
                self.log_params(run_id, params)
            yield run_id


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return os.environ.get("USER", "unknown")


def _log_metric_batch(client, run_id: str, rows: list[tuple[str, float, int, int]], model_id: str | None = None) -> None:
    """`model_id`: the values are linked to that LoggedModel too (and land in the run as well, where rows
    equal to ones already there, same key, value, step and timestamp, are not stored twice)."""
    from mlflow.entities import Metric

    metrics = [Metric(key[:MAX_KEY], value, ts, step, model_id=model_id) for key, value, step, ts in rows]
    for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + MAX_METRICS_PER_BATCH])


class RunLogger:
    """Step metrics from trainer rank 0 into the stage's run, buffered into few `log_batch` calls.

    Flushes when `flush_every` metric values are waiting or `flush_seconds` have passed, and on
    close. Flushing runs in the caller's thread: at one call per ~10 s the cost is a few ms, and it
    keeps ordering and shutdown simple. A tracking outage must not end a training run, so a failed
    flush keeps the values (up to `max_buffer`) and warns; they go with the next flush.
    With `uri` or `run_id` None every call is a no-op (a run with no tracking, other ranks).
    """

    def __init__(
        self,
        uri: str | None,
        run_id: str | None,
        flush_every: int = 200,
        flush_seconds: float = 10.0,
        max_buffer: int = 100_000,
    ):
        self.uri, self.run_id = uri, run_id
        self.enabled = bool(uri and run_id)
        self.flush_every, self.flush_seconds, self.max_buffer = flush_every, flush_seconds, max_buffer
        self._buffer: list[tuple[str, float, int, int]] = []
        # the last values of each metric (value, step, timestamp): what a checkpoint's LoggedModel links
        self._recent: dict[str, deque[tuple[float, int, int]]] = {}
        self._run_info: tuple[str, dict[str, str]] | None = None  # experiment id, tags of the run
        self._last_flush = time.monotonic()
        self._client = mlflow_client(uri) if self.enabled else None
        self.dropped = 0
        self.closed = False

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if not self.enabled:
            return
        if self.closed:
            raise RuntimeError("RunLogger.log_metrics after close()")
        ts = _now_ms()
        for key, value in metrics.items():
            row = (key, _as_float(value), int(step or 0), ts)
            self._buffer.append(row)
            self._recent.setdefault(key, deque(maxlen=RECENT_VALUES)).append(row[1:])
        if len(self._buffer) >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def log_params(self, params: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten_params(params).items()]
        try:
            for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
                self._client.log_batch(self.run_id, params=items[i : i + MAX_PARAMS_PER_BATCH])
        except Exception as exc:  # e.g. a resumed job re-logging a param with a new value
            log.warning("MLflow log_params into run %s failed: %s", self.run_id, exc)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not self.enabled:
            return
        try:
            path = Path(path)
            if path.is_dir():
                self._client.log_artifacts(self.run_id, str(path), artifact_path)
            else:
                self._client.log_artifact(self.run_id, str(path), artifact_path)
        except Exception as exc:
            log.warning("MLflow log_artifact %s into run %s failed: %s", path, self.run_id, exc)

    def log_checkpoint_model(self, step: int, checkpoint_uri: str, stage: str) -> str | None:
        """A committed checkpoint as MLflow 3's LoggedModel, returning its id (None when tracking is off
        or MLflow failed: a warning, never an error, as for metrics). An external model, as
        `mlflow.create_external_model` makes one: the weights stay in the object store and MLflow holds
        the record (and the MLmodel file that lets the registry take it), named `STAGE-step-N`, its
        source the stage's run, with step, checkpoint URI and the stage's fingerprint as tags and params,
        the run's latest value of each metric at or before `step` linked to it (the model page's
        metrics), and the run's outputs naming it at that step."""
        if not self.enabled:
            return None
        model_id = None
        try:
            from mlflow.entities import LoggedModelOutput

            self.flush()  # the run's own rows first; the linked copies below are the same rows
            experiment_id, run_tags = self._run_tags()
            stage = run_tags.get("stage") or stage
            fingerprint = run_tags.get("fingerprint", "")
            about = {"stage": stage, "step": str(step), "checkpoint_uri": checkpoint_uri, "fingerprint": fingerprint}
            model = self._client.create_logged_model(
                experiment_id, name=f"{stage.replace('/', '-')}-step-{step}", source_run_id=self.run_id,
                tags={**about, "mlflow.model.isExternal": "true"}, params=about, model_type=CHECKPOINT_MODEL_TYPE)
            model_id = model.model_id
            self._client.log_outputs(self.run_id, [LoggedModelOutput(model_id, step)])
            rows = []
            for key, values in self._recent.items():
                at = [v for v in values if v[1] <= step]
                if at:
                    value, at_step, ts = at[-1]
                    rows.append((key, value, at_step, ts))
            _log_metric_batch(self._client, self.run_id, rows, model_id=model_id)
            self._write_mlmodel(model)
            self._client.finalize_logged_model(model_id, "READY")
            return model_id
        except Exception as exc:  # noqa: BLE001 - a tracking failure must never end a training run
            log.warning("MLflow LoggedModel for checkpoint step %d (%s) in run %s failed: %s", step, checkpoint_uri,
                        self.run_id, exc)
            if model_id is not None:
                try:
                    self._client.finalize_logged_model(model_id, "FAILED")
                except Exception:  # noqa: BLE001 - already warned
                    pass
            return None

    def _run_tags(self) -> tuple[str, dict[str, str]]:
        if self._run_info is None:
            run = self._client.get_run(self.run_id)
            self._run_info = (run.info.experiment_id, dict(run.data.tags))
        return self._run_info

    def _write_mlmodel(self, model) -> None:
        """MLflow's own spec of an external model (what `create_external_model` uploads): a few hundred
        bytes that let `models:/<model_id>` be registered; no weights."""
        import tempfile

        from mlflow.models.utils import get_external_mlflow_model_spec

        with tempfile.TemporaryDirectory() as tmp:
            get_external_mlflow_model_spec(model).save(os.path.join(tmp, "MLmodel"))
            self._client.log_model_artifacts(model.model_id, tmp)

    def flush(self) -> bool:
        """Send what is buffered; True when the buffer is empty afterwards."""
        if not self.enabled or not self._buffer:
            self._last_flush = time.monotonic()
            return True
        try:
            _log_metric_batch(self._client, self.run_id, self._buffer)
            self._buffer.clear()
            return True
        except Exception as exc:
            if len(self._buffer) > self.max_buffer:
                extra = len(self._buffer) - self.max_buffer
                del self._buffer[:extra]
                self.dropped += extra
            log.warning("MLflow metrics flush into run %s failed (%d values kept): %s", self.run_id, len(self._buffer), exc)
            return False
        finally:
            self._last_flush = time.monotonic()

    def close(self) -> None:
        if self.closed:
            return
        ok = self.flush()
        if not ok and self._buffer:
            self.dropped += len(self._buffer)
            log.warning("RunLogger closed with %d metric values never delivered", len(self._buffer))
            self._buffer.clear()
        self.closed = True

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

