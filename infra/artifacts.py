"""Content-addressed, immutable stage outputs: `{store}/{experiment}/{stage}/{fingerprint}/`.

The fingerprint hashes the stage name, its config section and its inputs' fingerprints (Marin's
versioned steps). `manifest.json` is written last: a folder without it does not exist. A stage
whose manifest is present is not run again; the input fingerprints are the lineage.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.store import Store, StoreError, join_key, sha256_file

MANIFEST = "manifest.json"
FINGERPRINT_CHARS = 16
_FINGERPRINT = re.compile(rf"^[0-9a-f]{{{FINGERPRINT_CHARS}}}$")


def plain(obj: Any) -> Any:
    """JSON-ready data: pydantic models dumped by field, paths as strings, sets sorted."""
    if hasattr(obj, "model_dump"):
        return plain(obj.model_dump(mode="json"))
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(plain(v) for v in obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def canonical_json(obj: Any) -> str:
    return json.dumps(plain(obj), sort_keys=True, separators=(",", ":"), default=str)


def fingerprint(stage: str, section: Any, inputs: dict[str, str] | None = None) -> str:
    """Short stable hash of what determines a stage's output: stage name, config section, and the
    fingerprints of its inputs (so a change upstream re-runs everything downstream)."""
    payload = canonical_json({"stage": stage, "config": section, "inputs": dict(sorted((inputs or {}).items()))})
    return hashlib.sha256(payload.encode()).hexdigest()[:FINGERPRINT_CHARS]


def code_version() -> str:
    """The commit the code comes from, `-dirty` when the working tree has changes (recorded in every
    manifest; a cache hit built by other code says so: tasks/stage.py); "unknown" outside git."""
    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True, text=True, timeout=5,
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
    def files(self) -> dict[str, dict]:
        return self.manifest.get("files", {})

    @property
    def inputs(self) -> dict[str, str]:
        return self.manifest.get("inputs", {})

    @property
    def created(self) -> float:
        return float(self.manifest.get("finished_at", 0.0))

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    def download(self, local: str | Path) -> Path:
        """Fetch every file, verifying each sha256 against the manifest (ChecksumMismatch on a bad
        copy). Files already present with the right sha256 are kept. The manifest is written last,
        as in the store, so a local copy holding `manifest.json` is complete."""
        local = Path(local)
        (local / MANIFEST).unlink(missing_ok=True)
        for name, meta in self.files.items():
            dst = local / name
            if dst.is_file() and dst.stat().st_size == int(meta["size"]) and sha256_file(dst) == meta["sha256"]:
                continue
            self.store.get_file(self.key(name), dst, sha256=meta["sha256"])
        local.mkdir(parents=True, exist_ok=True)
        (local / MANIFEST).write_text(json.dumps(self.manifest, indent=2, sort_keys=True, default=str))
        return local


def artifact_prefix(experiment: str, stage: str, fp: str) -> str:
    for what, value in (("experiment", experiment), ("stage", stage), ("fingerprint", fp)):
        if not value or value != value.strip("/") or "//" in value or ".." in value.split("/"):
            raise StoreError(f"invalid artifact {what} {value!r}")
    return f"{experiment}/{stage}/{fp}"


def find_artifact(store: Store, experiment: str, stage: str, fp: str) -> Artifact | None:
    """The committed artifact, or None when it is missing or has no manifest (uncommitted)."""
    key = f"{artifact_prefix(experiment, stage, fp)}/{MANIFEST}"
    try:
        manifest = store.get_json(key)
    except FileNotFoundError:
        return None
    return Artifact(store, experiment, stage, fp, manifest)


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
    with_store_files: bool = False,
) -> Artifact:
    """Upload `local_dir` and commit it with `manifest.json`, written last. `with_store_files`: files
    already under the artifact's prefix in the store (what a training job wrote there straight from
    its nodes: checkpoints, metrics.jsonl, result.json) are committed too, described by the store's
    size and sha256; a local file of the same name replaces the store's.

    Re-committing a fingerprint (a forced re-run) first removes the old manifest, so the folder is
    invisible while its files are replaced and a crash half way never leaves a manifest describing
    files that are not there.
    """
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise NotADirectoryError(f"commit_artifact: {local_dir} is not a folder")
    prefix = artifact_prefix(experiment, stage, fp)
    store.delete(f"{prefix}/{MANIFEST}")
    files = {}
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        name = path.relative_to(local_dir).as_posix()
        if name == MANIFEST:
            continue  # ours is written last; a stage's own top-level manifest.json would be overwritten
        files[name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        store.put_file(path, f"{prefix}/{name}")
    for key in store.list(prefix) if with_store_files else []:
        name = key[len(prefix) + 1:]
        if name and name != MANIFEST and name not in files:
            files[name] = _describe(store, key)
    manifest = {
        **plain(extra or {}),  # first: the contract's own fields below always win
        "stage": stage,
        "experiment": experiment,
        "fingerprint": fp,
        "files": files,
        "config": plain(config),
        "inputs": dict(inputs or {}),
        "code_version": code_version(),
        "started_at": started_at or time.time(),
        "finished_at": time.time(),
    }
    store.put_json(manifest, f"{prefix}/{MANIFEST}")
    return Artifact(store, experiment, stage, fp, manifest)


def _describe(store: Store, key: str) -> dict:
    """size and sha256 of an object already in the store; hashed from a download when the store has no
    sha256 for it (an object another tool wrote)."""
    info = store.object_info(key)
    if not info.get("sha256"):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            info["sha256"] = sha256_file(store.get_file(key, Path(tmp) / "object"))
    return {"sha256": info["sha256"], "size": int(info["size"])}


def list_artifacts(store: Store, experiment: str | None = None, stage: str | None = None) -> list[Artifact]:
    """Committed artifacts, newest first. Folders without a manifest are invisible.

    Found by their `manifest.json` keys, so nested stage names (`ablations/<proxy>`) are found too;
    a candidate counts only when its folder name is a fingerprint and its manifest names the same
    experiment, stage and fingerprint as its path (a checkpoint's own manifest.json inside an
    artifact does not).
    """
    found = []
    stage = (stage or "").strip("/")
    for key in store.list(join_key(experiment, stage) if experiment else ""):
        parts = key.split("/")
        if len(parts) < 4 or parts[-1] != MANIFEST or not _FINGERPRINT.match(parts[-2]):
            continue
        exp, st, fp = parts[0], "/".join(parts[1:-2]), parts[-2]
        if (experiment and exp != experiment) or (stage and st != stage and not st.startswith(stage + "/")):
            continue
        try:
            manifest = store.get_json(key)
        except (FileNotFoundError, ValueError):  # deleted meanwhile, or not a manifest of ours
            continue
        if not isinstance(manifest, dict):
            continue
        if (manifest.get("experiment"), manifest.get("stage"), manifest.get("fingerprint")) != (exp, st, fp):
            continue
        found.append(Artifact(store, exp, st, fp, manifest))
    return sorted(found, key=lambda a: a.created, reverse=True)


def latest_artifact(store: Store, experiment: str, stage: str) -> Artifact | None:
    """The newest committed artifact of exactly this stage (not of nested stages under it)."""
    arts = [a for a in list_artifacts(store, experiment, stage) if a.stage == stage]
    return arts[0] if arts else None
