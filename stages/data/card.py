"""The data card: what went in and out of every step, written as data_card.json and data_card.md."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


class DataCard:
    """Collects sections (title -> rows or a dict of figures) and renders them as JSON and Markdown."""

    def __init__(self, title: str):
        self.title = title
        self.data: dict[str, Any] = {}
        self._tables: list[tuple[str, list[dict], list[str]]] = []
        self._figures: list[tuple[str, dict]] = []

    def figures(self, key: str, title: str, values: dict[str, Any]) -> None:
        self.data[key] = values
        self._figures.append((title, values))

    def table(self, key: str, title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
        self.data[key] = rows
        self._tables.append((title, rows, columns))

    def raw(self, key: str, value: Any) -> None:
        self.data[key] = value

    def markdown(self) -> str:
        parts = [f"# {self.title}", ""]
        for title, values in self._figures:
            parts += [f"## {title}", "", markdown_table([{"figure": k, "value": v} for k, v in values.items()], ["figure", "value"]), ""]
        for title, rows, columns in self._tables:
            parts += [f"## {title}", "", markdown_table(rows, columns), ""]
        return "\n".join(parts)

    def write(self, out_dir: Path, stem: str = "data_card") -> Path:
        (out_dir / f"{stem}.json").write_text(json.dumps(self.data, indent=2, sort_keys=False, default=str))
        md = out_dir / f"{stem}.md"
        md.write_text(self.markdown())
        return md


@contextmanager
def quiet_datasets():
    """Silence datasets' progress bars while a stage writes or maps (restored afterwards)."""
    import datasets

    was_disabled = datasets.is_progress_bar_enabled() is False
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
