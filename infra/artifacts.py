"""Content-addressed, immutable stage outputs: `{store}/{experiment}/{stage}/{fingerprint}/`.

The fingerprint hashes the stage name, its config section and its inputs' fingerprints (Marin's
versioned steps). `manifest.json` is written last: a folder without it does not exist. A stage
whose manifest is present is not run again; the input fingerprints are the lineage.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.store import Store, sha256_file

MANIFEST = "manifest.json"
FINGERPRINT_CHARS = 16


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(stage: str, section: Any, inputs: dict[str, str] | None = None) -> str:
    """Short stable hash of what determines a stage's output."""
    payload = canonical_json({"stage": stage, "config": section, "inputs": dict(sorted((inputs or {}).items()))})
    return hashlib.sha256(payload.encode()).hexdigest()[:FINGERPRINT_CHARS]


def code_version() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclass(frozen=True)
class Artifact:
    """A committed stage output."""

    store: Store
    experiment: str
    stage: str
    fingerprint: str
    manifest: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def prefix(self) -> str:
        return artifact_prefix(self.experiment, self.stage, self.fingerprint)

    @property
    def uri(self) -> str:
        return self.store.url(self.prefix)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def url(self, name: str) -> str:
        return self.store.url(self.key(name))

    @property
    def inputs(self) -> dict[str, str]:
        return self.manifest.get("inputs", {})

    @property
    def created(self) -> float:
        return float(self.manifest.get("finished_at", 0.0))

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.manifest.get("files", {}).values())

    def download(self, local: str | Path) -> Path:
        """Fetch every file, verifying each sha256 against the manifest."""
        local = Path(local)
        for name, meta in self.manifest.get("files", {}).items():
            self.store.get_file(self.key(name), local / name, sha256=meta["sha256"])
        return local


def artifact_prefix(experiment: str, stage: str, fp: str) -> str:
    return f"{experiment}/{stage}/{fp}"


def find_artifact(store: Store, experiment: str, stage: str, fp: str) -> Artifact | None:
    """The committed artifact, or None when it is missing or has no manifest (uncommitted)."""
    key = f"{artifact_prefix(experiment, stage, fp)}/{MANIFEST}"
    if not store.exists(key):
        return None
    return Artifact(store, experiment, stage, fp, store.get_json(key))


def commit_artifact(
    store: Store,
    experiment: str,
    stage: str,
    fp: str,
    local_dir: str | Path,
    *,
    config: Any,
    inputs: dict[str, str] | None = None,
    started_at: float | None = None,
    extra: dict | None = None,
) -> Artifact:
    """Upload `local_dir` and commit it with `manifest.json`, written last."""
    local_dir = Path(local_dir)
    prefix = artifact_prefix(experiment, stage, fp)
    files = {}
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        name = path.relative_to(local_dir).as_posix()
        files[name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        store.put_file(path, f"{prefix}/{name}")
    manifest = {
        "stage": stage,
        "experiment": experiment,
        "fingerprint": fp,
        "files": files,
        "config": config,
        "inputs": dict(inputs or {}),
        "code_version": code_version(),
        "started_at": started_at or time.time(),
        "finished_at": time.time(),
        **(extra or {}),
    }
    store.put_json(manifest, f"{prefix}/{MANIFEST}")
    return Artifact(store, experiment, stage, fp, manifest)


def list_artifacts(store: Store, experiment: str | None = None, stage: str | None = None) -> list[Artifact]:
    """Committed artifacts, newest first. Folders without a manifest are invisible."""
    found = []
    experiments = [experiment] if experiment else [e for e in store.iter_dirs("")]
    for exp in experiments:
        for st in ([stage] if stage else list(store.iter_dirs(exp))):
            for fp in store.iter_dirs(f"{exp}/{st}"):
                art = find_artifact(store, exp, st, fp)
                if art is not None:
                    found.append(art)
    return sorted(found, key=lambda a: a.created, reverse=True)


def latest_artifact(store: Store, experiment: str, stage: str) -> Artifact | None:
    arts = list_artifacts(store, experiment, stage)
    return arts[0] if arts else None
