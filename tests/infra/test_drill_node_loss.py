"""`eightfold drill node-loss` (infra/drill.py): a two-node job (Slurm's two nodes when they are up, as in
CI, else the local launcher's simulated nodes; each node with its own folder, sharing only the store)
loses a node at a random step; the retry resumes from the last committed checkpoint on both nodes (the
reference's weights, bit for bit) or, elastic, on the node left (the loss within the stated tolerance),
and no path outside the store is written by both."""

from __future__ import annotations

import pytest

from fixtures.s3 import s3_endpoint, s3_store  # noqa: F401
from fixtures.trainer_data import byte_tokens, tiny_config  # noqa: F401
from infra.config import LifecycleConfig
from infra.drill import SlurmNodes, node_loss

pytestmark = pytest.mark.timeout(600)


def _config(tmp_path, store: str, endpoint: str | None = None) -> LifecycleConfig:
    data = tiny_config(steps=8, warmup_steps=1, checkpoint={"every": 3, "async_save": True}).model_dump(mode="json")
    data["infra"].update(workdir=str(tmp_path / "work"), store=store, s3_endpoint_url=endpoint,
                         tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    return LifecycleConfig.model_validate(data)


def _check(report: dict, steps: int = 8) -> None:
    assert report["nodes"] == 2
    assert 3 <= report["resumed_from_step"] <= report["killed_at_step"] < steps
    assert report["lost_steps"] == report["killed_at_step"] - report["resumed_from_step"]
    assert report["shared_paths"] == 0, report["shared_path_examples"]
    assert len(report["written_paths_per_node"]) == 2 and min(report["written_paths_per_node"]) > 0  # it looked
    assert report["equal"], report
    assert 0 < report["restart_s"] < 300


def test_node_loss_on_the_same_nodes_is_bit_for_bit(s3_store, byte_tokens, tmp_path):
    s3_store.put_dir(byte_tokens, "tokens")
    cfg = _config(tmp_path, s3_store.url("runs"), s3_store.endpoint_url)
    report = node_loss(cfg, s3_store.url("tokens"), elastic=False, seed=1, launcher="local", log=lambda m: None)
    _check(report)
    assert report["resumed_on_nodes"] == 2 and report["final_loss"] == report["reference_final_loss"]
    assert report["checkpoint_uri"].startswith(s3_store.url("runs"))


def test_node_loss_elastic_resumes_on_the_node_left(byte_tokens, tmp_path):
    """On Slurm when two nodes are up (CI starts them): the retry excludes the lost node."""
    cfg = _config(tmp_path, f"file://{tmp_path / 'store'}")
    report = node_loss(cfg, str(byte_tokens), elastic=True, seed=2, launcher="auto", log=lambda m: None)
    _check(report)
    assert report["resumed_on_nodes"] == 1
    assert report["launcher"] == ("slurm" if SlurmNodes.up() else "local")
