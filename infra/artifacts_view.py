"""`eightfold artifacts [STAGE] [--json]`: the committed artifacts of a config's experiment, newest
first, with stage, fingerprint, time, size, inputs and URI (a table for people, JSON for scripts)."""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from infra.artifacts import Artifact, list_artifacts
from infra.config import ConfigError, load_config
from infra.store import StoreError
from infra.workspace import Workspace


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def iso_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds") if ts else ""


def artifact_row(art: Artifact) -> dict:
    """One artifact as plain JSON data (what `--json` prints for each)."""
    m = art.manifest
    return {
        "experiment": art.experiment,
        "stage": art.stage,
        "fingerprint": art.fingerprint,
        "created": iso_time(art.created),
        "created_ts": art.created,
        "started_at": m.get("started_at"),
        "size_bytes": art.size,
        "files": len(art.files),
        "inputs": dict(art.inputs),
        "uri": art.uri,
        "code_version": m.get("code_version"),
        "mlflow_run_id": m.get("mlflow_run_id"),
    }


def artifacts_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("stage", no_wrap=True)
    table.add_column("fingerprint", no_wrap=True)
    table.add_column("created (UTC)", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("inputs", overflow="fold")
    table.add_column("uri", overflow="fold")
    for r in rows:
        inputs = "\n".join(f"{k}={v}" for k, v in sorted(r["inputs"].items())) or "-"
        table.add_row(r["stage"], r["fingerprint"], r["created"].replace("+00:00", ""),
                      human_size(r["size_bytes"]), inputs, r["uri"])
    return table


def artifacts_command(config: str | None, overrides: list[str], stage: str | None, as_json: bool) -> int:
    """List committed artifacts; returns the exit code (0 ok, 1 store unreadable, 2 bad config)."""
    err = Console(stderr=True)
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        err.print(f"[red]{escape(str(exc))}[/red]", highlight=False)
        return 2
    ws = Workspace.from_config(cfg)
    try:
        rows = [artifact_row(a) for a in list_artifacts(ws.store, ws.experiment, stage)]
    except (StoreError, OSError) as exc:
        err.print(f"[red]cannot read the artifact store {escape(ws.store_uri)}: {escape(str(exc))}[/red]", highlight=False)
        return 1
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    where = ws.store.url(ws.experiment + (f"/{stage.strip('/')}" if stage else ""))
    if not rows:
        Console().print(f"no committed artifacts{f' of stage {stage!r}' if stage else ''} under {where}",
                        markup=False, highlight=False)
        return 0
    total = sum(r["size_bytes"] for r in rows)
    # Piped output (scripts, logs) gets a wide table so fingerprints and URIs are never folded.
    console = Console() if sys.stdout.isatty() else Console(width=max(Console().width, 200))
    console.print(artifacts_table(rows, f"{len(rows)} artifact(s), {human_size(total)}, in {where}"))
    return 0
