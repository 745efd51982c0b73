"""Nodes a launcher keeps jobs off: those that failed a health check before a job (infra/node_health.py),
recorded by the stage in an exclude file that every later submit reads. Slurm turns the list into
`--exclude`, Kubernetes into a required node affinity (`metadata.name NotIn [...]`)."""

from __future__ import annotations

from pathlib import Path


def read_exclude_file(path: str | Path | None) -> list[str]:
    """Node names in an exclude file: one per line, `#` starts a comment; a missing file is empty."""
    if path is None or not Path(path).exists():
        return []
    nodes = []
    for line in Path(path).read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            nodes.append(name)
    return nodes


def record_bad_nodes(path: str | Path, nodes: list[str], reason: str = "") -> None:
    """Append nodes that failed a health check to an exclude file (read by every later submit)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    known = set(read_exclude_file(path))
    with open(path, "a") as f:
        for node in nodes:
            if node not in known:
                f.write(f"{node}{'  # ' + reason if reason else ''}\n")
                known.add(node)


def excluded_nodes(configured: list[str], recorded: list[str]) -> list[str]:
    """The config's own list, then the recorded ones (an exclude file's), each node once."""
    return list(dict.fromkeys([*configured, *recorded]))
