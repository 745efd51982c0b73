"""The comparison across the lifecycle: one table, variants (rows) by task metrics (columns), each
cell a value with its stderr, written as markdown and JSON, and one nested MLflow run per variant
(under the stage's run) so the MLflow UI's compare view lines them up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# How each lm-eval metric is printed; anything else gets 4 significant digits.
_FORMAT = {"word_perplexity": "{:.4g}", "byte_perplexity": "{:.4f}", "bits_per_byte": "{:.4f}"}


def columns(summaries: dict[str, dict[str, Any]], tasks: list[str]) -> list[tuple[str, str]]:
    """(task, metric) pairs in task order, metrics in the order lm-eval reported them."""
    cols: list[tuple[str, str]] = []
    for task in tasks:
        for s in summaries.values():
            for metric in s["metrics"].get(task, {}):
                if (task, metric) not in cols:
                    cols.append((task, metric))
    return cols


def _cell(m: dict[str, Any] | None, metric: str) -> str:
    if m is None:
        return "-"
    fmt = _FORMAT.get(metric, "{:.4g}")
    text = fmt.format(m["value"])
    if m.get("stderr") is not None:
        text += " ± " + fmt.format(m["stderr"])
    return text


def build_table(summaries: dict[str, dict[str, Any]], tasks: list[str],
                skipped: dict[str, str] | None = None, notes: dict[str, str] | None = None,
                caption: str = "") -> dict[str, Any]:
    """The table as data: {"columns": [...], "rows": [{"variant", "cells": {"task/metric": {...}}}], ...}."""
    cols = columns(summaries, tasks)
    rows = []
    for variant, s in summaries.items():
        cells = {f"{t}/{m}": s["metrics"].get(t, {}).get(m) for t, m in cols}
        rows.append({"variant": variant, "cells": cells, "n": s.get("n", {})})
    return {"columns": [f"{t}/{m}" for t, m in cols], "rows": rows, "skipped": dict(skipped or {}),
            "notes": dict(notes or {}), "caption": caption}


def as_columns(table: dict[str, Any]) -> dict[str, list]:
    """The table as MLflow's log_table takes it: a column per figure (value, and its stderr beside it)."""
    out: dict[str, list] = {"variant": [r["variant"] for r in table["rows"]]}
    for c in table["columns"]:
        cells = [r["cells"].get(c) or {} for r in table["rows"]]
        out[c] = [cell.get("value") for cell in cells]
        if any(cell.get("stderr") is not None for cell in cells):
            out[f"{c} stderr"] = [cell.get("stderr") for cell in cells]
    return out


def to_markdown(table: dict[str, Any]) -> str:
    cols = table["columns"]
    lines = ["# Evaluation: variants x tasks", "",
             "Each cell: value ± stderr (lm-eval's; bootstrap over documents for corpus perplexities). "
             "Arrows: which direction is better.", ""]
    if table.get("caption"):
        lines += [table["caption"], ""]
    arrows = {}
    for c in cols:
        hib = next((r["cells"][c]["higher_is_better"] for r in table["rows"] if r["cells"].get(c)), True)
        arrows[c] = "↑" if hib else "↓"
    lines.append("| variant | " + " | ".join(f"{c} {arrows[c]}" for c in cols) + " |")
    lines.append("|---|" + "---|" * len(cols))
    for r in table["rows"]:
        lines.append(f"| {r['variant']} | " + " | ".join(_cell(r["cells"].get(c), c.split("/", 1)[1]) for c in cols) + " |")
    if table["rows"]:
        n = table["rows"][0]["n"]
        lines += ["", "Examples per task: " + ", ".join(f"{t}={k}" for t, k in n.items())]
    if table.get("notes"):
        lines += ["", "How variants were run:"] + [f"- {v}: {why}" for v, why in table["notes"].items()]
    if table["skipped"]:
        lines += ["", "Not evaluated:"] + [f"- {v}: {why}" for v, why in table["skipped"].items()]
    return "\n".join(lines) + "\n"


def write_table(table: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "evaluation.md", out_dir / "evaluation.json"
    md.write_text(to_markdown(table), encoding="utf-8")
    js.write_text(json.dumps(table, indent=2, default=float), encoding="utf-8")
    return md, js


def flat_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """`task/metric` and `task/metric_stderr` as floats, for MLflow and the stage's key figures."""
    out = {}
    for task, metrics in summary["metrics"].items():
        for metric, m in metrics.items():
            key = f"{task}/{metric.replace(',', '_')}"
            out[key] = m["value"]
            if m.get("stderr") is not None:
                out[key + "_stderr"] = m["stderr"]
    return out


def log_variant_runs(tracker, parent_run_id: str, summaries: dict[str, dict[str, Any]],
                     params: dict[str, dict[str, Any]], files: dict[str, Path] | None = None) -> dict[str, str]:
    """One nested run per variant under `parent_run_id`: params (path, backend...), metrics, and its
    raw result file. Returns variant -> run id."""
    run_ids = {}
    for variant, s in summaries.items():
        with tracker.run(f"evaluate/{variant}", parent_run_id=parent_run_id,
                         tags={"stage": "evaluate", "variant": variant}) as run_id:
            tracker.log_params(run_id, {"variant": variant, **params.get(variant, {})})
            tracker.log_metrics(run_id, flat_metrics(s))
            if files and variant in files:
                tracker.log_artifact(run_id, files[variant])
        run_ids[variant] = run_id
    return run_ids
