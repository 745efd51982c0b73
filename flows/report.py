"""The short summary printed at the end of `eightfold run` / `eightfold stage`: what ran, where to look."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from infra.config import LifecycleConfig
from infra.workspace import Workspace


def print_summary(cfg: LifecycleConfig, refs: dict[str, dict]) -> None:
    ws = Workspace.from_config(cfg)
    console = Console()
    table = Table(title=f"eightfold: {cfg.name}")
    for col in ("stage", "status", "fingerprint", "key figures", "artifact"):
        table.add_column(col, overflow="fold")
    for stage, ref in refs.items():
        summary = ref.get("summary") or {}
        figures = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in list(summary.items())[:4] if isinstance(v, (int, float, str))
        )
        table.add_row(stage, "cached" if ref.get("cached") else "ran", ref["fingerprint"], figures, ref["uri"])
    console.print(table)
    console.print(f"MLflow:  mlflow ui --backend-store-uri {ws.tracking_uri}   (experiment {ws.experiment!r})")
    console.print("Prefect: prefect server start   (then open http://127.0.0.1:4200)")
