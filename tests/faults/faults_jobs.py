"""Helpers of the fault tests: tiny job files, an in-process run, a torchrun launch of `-m trainer`
with restarts, and the weights of a committed checkpoint read back with DCP alone (not through the
Checkpointer under test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fixtures.trainer_data import tiny_config
from infra.launch.job import JobResult, JobSpec

ROOT = Path(__file__).resolve().parents[2]


def job(tmp: Path, tokens: Path, name: str, *, dp: int = 1, resume: str = "latest", parallel: dict | None = None,
        output: str | None = None, **pretrain) -> JobSpec:
    pretrain.setdefault("steps", 6)
    pretrain.setdefault("micro_batch_size", 2)
    pretrain.setdefault("global_batch_size", 8)
    pretrain.setdefault("warmup_steps", 1)
    cfg = tiny_config(**pretrain).model_dump(mode="json")
    cfg["parallel"].update({"dp": dp, "nproc_per_node": dp, **(parallel or {})})
    cfg["infra"]["health_check"] = True
    return JobSpec(job_id=name, stage="pretrain", config=cfg, inputs={"tokens": str(tokens)},
                   output=output or str(tmp / name / "out"), workdir=str(tmp / name / "work"), resume=resume)


def run_in_process(spec: JobSpec):
    from trainer.trainer import Trainer

    return Trainer(spec).run()


def launch(spec: JobSpec, tmp: Path, nproc: int, max_restarts: int = 0, timeout: float = 150) -> tuple[int, str]:
    """torchrun --nproc-per-node N --max-restarts R -m trainer JOB.yaml; returns (exit code, log)."""
    job_file = spec.write(tmp / f"{spec.job_id}.yaml")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", "trainer", str(job_file)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def result(spec: JobSpec) -> JobResult:
    return JobResult.model_validate_json((Path(spec.output) / "result.json").read_text())


def checkpoint_weights(folder: str | Path, cfg: dict) -> dict[str, torch.Tensor]:
    """The model tensors of one checkpoint folder, loaded into a fresh model's state dict by DCP."""
    from infra.config import LifecycleConfig
    from trainer.model import Transformer

    model = Transformer(LifecycleConfig.model_validate(cfg).model)
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(state, checkpoint_id=str(folder).removeprefix("file://"))
    return state["model"]


def losses(spec: JobSpec) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(spec.output) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def assert_equal_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max():.3g}"
