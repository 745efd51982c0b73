"""A stage's cache hit (tasks/stage.py): the fingerprint covers config and inputs, not code, so a hit
on an artifact built by other code says which code built it and how to rebuild."""

from __future__ import annotations

import infra.artifacts
import tasks.stage as stage_task
from infra.artifacts import commit_artifact
from infra.config import load_config
from infra.workspace import Workspace


def test_a_cache_hit_built_by_other_code_says_so(tmp_path, monkeypatch):
    cfg = load_config("micro")
    cfg.infra.workdir = str(tmp_path / "work")
    ws = Workspace.from_config(cfg)
    out = tmp_path / "out"
    out.mkdir()
    (out / "card.md").write_text("data")
    monkeypatch.setattr(infra.artifacts, "code_version", lambda: "aaaaaaaaaaaa")
    art = commit_artifact(ws.store, ws.experiment, "data", stage_task.stage_fingerprint(cfg, "data", {}), out, config={})
    logs: list[str] = []
    monkeypatch.setattr(stage_task, "code_version", lambda: "aaaaaaaaaaaa")
    ref = stage_task.execute_stage(cfg, "data", {}, log=logs.append)
    assert ref.cached and logs == [f"data: cached {art.uri}"]
    monkeypatch.setattr(stage_task, "code_version", lambda: "bbbbbbbbbbbb-dirty")
    ref = stage_task.execute_stage(cfg, "data", {}, log=logs.append)
    assert ref.cached and logs[-1] == (f"data: cached {art.uri} (built by code aaaaaaaaaaaa, this is "
                                       "bbbbbbbbbbbb-dirty: `--force data` rebuilds it)")
