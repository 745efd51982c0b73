"""ZeRO-1's fp32 masters in a checkpoint when they are copies (bf16 parameters): restored bit for bit,
taken from a plain checkpoint's fp32 weights when it has none, and stored at their parameters' global
offsets (read back by DCP alone in one process). The 2-rank half runs in zero1_masters_worker.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from faults_jobs import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORKER = Path(__file__).with_name("zero1_masters_worker.py")


def test_zero1_bf16_masters_round_trip(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKER.parent}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]

    # One process, DCP alone: the masters by parameter name, at the parameters' full shapes.
    folder = next((tmp_path / "bf16" / "store" / "checkpoints").iterdir())
    saved = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    keys = [k for k in saved if k.endswith(".master")]
    assert sorted(keys) == sorted(f"optim.state.{n}.master" for n in ("0.weight", "0.bias", "1.weight", "1.bias",
                                                                     "2.weight", "2.bias"))
    masters = {k: torch.zeros(saved[k].size) for k in keys}
    dcp.load(masters, checkpoint_id=str(folder))
    seen: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        for fqn, (start, master) in torch.load(tmp_path / f"rank{rank}.pt").items():
            full = masters[f"optim.state.{fqn}.master"].reshape(-1)
            assert torch.equal(full[start:start + master.numel()], master), fqn
            mask = seen.setdefault(fqn, torch.zeros(full.numel(), dtype=torch.bool))
            mask[start:start + master.numel()] = True
    assert all(mask.all() for mask in seen.values())  # the two ranks' segments cover every parameter
    assert any(len(saved[k].chunks) > 1 for k in keys)  # some parameter is cut between the ranks
