"""Expert parallel padded to capacity (model.moe.pad_to_capacity; GShard, Megatron's
--moe-pad-expert-input-to-capacity): over ep=2 ranks (one torchrun launch, expert_padding_worker.py), one MoE
layer gives the whole layer's output and input gradient on each rank's tokens, and each expert's owner holds
the gradient summed over the ranks' tokens, with and without padding, with tokens dropped (capacity factor
0.75) and without (2.0). Padded, the all-to-alls move a fixed E x capacity rows per rank whatever the routing
(4 exchanges: dispatch and combine, forward and backward), the bytes `eightfold estimate` counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infra.config.model import MoEConfig
from trainer.estimate.formulas import expert_capacity

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("expert_padding_worker.py")
DIM, E, K, T, EP = 16, 4, 2, 40, 2


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert_padding") / "found.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={EP}", str(WORKER), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["pad=True factor=0.75", "pad=True factor=2.0",
                                  "pad=False factor=0.75", "pad=False factor=2.0"])
def test_expert_parallel_equals_the_whole_layer(found, case):
    for rank, by_case in enumerate(found):
        # fp32, the same products summed in another order (an expert's gradient: over both ranks' rows at
        # once rather than per rank then all-reduced; the combine's index_add): at most 2T = 80 terms, so
        # within 80 fp32 epsilons (1e-5) of the largest value (measured: 3e-7).
        worst = by_case[case]["max_rel_diff"]
        assert max(worst.values()) <= 2 * T * torch.finfo(torch.float32).eps, (rank, case, worst)


@pytest.mark.distributed
def test_padded_all_to_all_bytes_are_fixed_by_the_capacity(found):
    for factor in (0.75, 2.0):
        cap = expert_capacity(factor, T, K, E)
        # 4 exchanges of E * cap rows of DIM fp32 values, (ep - 1)/ep of them to the other rank
        want = 4 * E * cap * DIM * 4 * (EP - 1) / EP
        for by_case in found:
            padded = by_case[f"pad={True} factor={factor}"]
            assert padded["capacity"] == cap
            assert padded["ep_calls"] == 4  # no counts exchange first
            assert padded["ep_bytes"] == want
    dropped = [by_case["pad=True factor=0.75"]["kept"] for by_case in found]
    assert min(dropped) < 1.0  # the small capacity really dropped tokens
    # Unpadded, the bytes follow the routing (and a counts all-to-all of E int64 goes first): this router's
    # are not the balanced figure, T * top_k rows (what the estimate assumes without padding).
    balanced = 4 * T * K * DIM * 4 * (EP - 1) / EP
    counts = E * 8 * (EP - 1) / EP
    for by_case in found:
        unpadded = by_case["pad=False factor=2.0"]
        assert unpadded["ep_calls"] == 5
        assert unpadded["ep_bytes"] - counts != balanced


def test_padding_needs_a_capacity():
    with pytest.raises(ValueError, match="pad_to_capacity.*capacity_factor"):
        MoEConfig(pad_to_capacity=True, capacity_factor=None)
