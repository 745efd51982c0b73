"""The same datatrove pipeline under each executor keeps the same documents: local (one process, two
processes), a local Ray cluster of two CPUs and the Slurm CI starts (tests/fixtures/slurm.py). The corpus is
small and cut into several shards so tasks really run apart; near-duplicates are planted across shards."""

import json
import random
import sys
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from infra.config import load_config
from infra.config.data import DataConfig, SourceConfig
from infra.workspace import Workspace
from stages.base import StageContext
from stages.data import run_clean

if "fixtures.slurm" not in sys.modules:  # until tests/conftest.py registers it in pytest_plugins
    from fixtures.slurm import slurm_cluster  # noqa: F401

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NAMES = ["textwrap.py", "fnmatch.py", "heapq.py", "glob.py", "shlex.py", "string.py", "colorsys.py", "sched.py"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    texts = [(STDLIB / n).read_text() for n in NAMES]
    rng = random.Random(0)
    copies = [t.replace(w, w + "_x", 1) for t in texts[:3] for w in [rng.choice(t.split())]]
    for k, chunk in enumerate([texts[:3], texts[3:6], texts[6:] + copies]):
        (d / f"{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunk))
    return d


def kept(tmp_path: Path, corpus: Path, **data) -> tuple[dict, dict]:
    cfg = load_config("tiny")
    cfg.data = DataConfig(sources=[SourceConfig(name="code", path=str(corpus))], task_mb=0.001, **data)
    cfg.infra.workdir = str(tmp_path / "ws")
    out = tmp_path / "out"
    summary = run_clean(StageContext(cfg, Workspace.from_config(cfg), out))
    files = {split: {f.name: pq.read_table(f).to_pylist() for f in sorted((out / split).glob("*.parquet"))}
             for split in ("train", "validation")}
    card = json.loads((out / "data_card.json").read_text())
    return files, {"tasks": summary["tasks"], "steps": card["steps"], "drops": card["drops"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    files, card = kept(tmp_path_factory.mktemp("local1"), corpus, workers=1)
    assert card["tasks"] == 3
    dropped = {(r["step"], r["reason"]): r["documents"] for r in card["drops"]}
    assert dropped.get(("near_dedup", "near_duplicate")) == 3  # the copies, from another shard than their originals
    return files, card


def test_two_local_processes_keep_the_same_documents(tmp_path, corpus, reference):
    assert kept(tmp_path, corpus, workers=2) == reference


@pytest.mark.slow
def test_ray_keeps_the_same_documents(tmp_path, corpus, reference):
    pytest.importorskip("ray")
    assert kept(tmp_path, corpus, executor="ray", workers=2) == reference


@pytest.mark.slow
def test_slurm_keeps_the_same_documents(tmp_path, corpus, reference, slurm_cluster):
    assert kept(tmp_path, corpus, executor="slurm", slurm={"time_limit": "10", "poll_s": 0.5,
                                                            "timeout_s": 600}) == reference


def test_executor_settings_are_validated():
    from pydantic import ValidationError

    src = [SourceConfig(name="a", path="x")]
    with pytest.raises(ValidationError, match="data.ray_address is set but data.executor is 'local'"):
        DataConfig(sources=src, ray_address="ray://head:10001")
    with pytest.raises(ValidationError, match="executor"):
        DataConfig(sources=src, executor="dask")
    with pytest.raises(ValidationError, match="not a Slurm --time"):
        DataConfig(sources=src, executor="slurm", slurm={"time_limit": "soon"})
    with pytest.raises(ValidationError, match="workers"):
        DataConfig(sources=src, workers=0)


def test_executor_settings_leave_the_fingerprint_alone():
    from stages.registry import STAGES

    cfg = load_config("tiny")
    base = STAGES["data"].section(cfg)
    moved = load_config("tiny", ["data.executor=ray", "data.workers=8", "data.ray_address=ray://head:10001"])
    assert STAGES["data"].section(moved) == base
    assert STAGES["data"].section(load_config("tiny", ["data.task_mb=4"])) != base  # shards follow task_mb
