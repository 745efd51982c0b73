"""Ring attention's numerics and wire (trainer/parallel/context_parallel.py), at cp=4 (three hops) on
one fixed batch with grouped-query heads (H=4 query heads, K=2 KV heads), against a reference computed
another way on one process: the whole sequence at once (no zigzag, no ring, no online softmax), K/V
expanded to the query heads, FlashAttention's forward and backward formulas written out in full.

- fp32: the ring equals the reference, and the reference equals torch's attention differentiated by
  autograd in float64.
- bf16: under bf16 autocast (fp32 tensors in and out, so nothing but the matmuls is rounded) the
  ring is compared with the reference run with bf16 matmul inputs. The tolerance is m, the reference's
  own bf16-vs-fp32 distance (relative Frobenius, same bf16-exact inputs: what rounding the matmul
  inputs moves in this result). The forward's output rounds P tile by tile (online softmax) where the
  reference rounds it whole: two independent roundings of size m, about sqrt(2) m apart, bounded by 2m.
  dQ and dK inherit that through D = rowsum(dO * O), which carries each computation's own forward
  roundings: also within 2m. dV = P^T dO has no D: the backward rounds exactly the reference's inputs
  (P from the saved log-sum-exp, dO), so only fp32 summation order separates them: within m/4.
  A ring whose passes ran in different precisions (the old one: bf16 forward under autocast, fp32
  backward) is 2.4..3.2 m away (dV 2.6 m) and fails. bf16 tensors without autocast give exactly the autocast
  results rounded to bf16.
- the wire: each forward hop sends K and V as KV heads in the compute dtype,
  2 x kv_heads x head_dim x local_seq x batch x element_size bytes, counted by CommCounter.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import context_parallel_worker as W  # noqa: E402

CP = 4


@pytest.fixture(scope="module")
def ring(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ring") / "ring.pt"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={CP}",
           str(HERE / "context_parallel_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out)


def reference(q, k, v, d_out, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Causal attention over the whole sequence and its gradients, every matmul's inputs rounded to
    `dtype` and summed in fp32, scores, softmax and D = rowsum(dO * O) in fp32 (FlashAttention's)."""
    def mm(a, b):
        return torch.matmul(a.to(dtype).float(), b.to(dtype).float())

    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    S, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    p = torch.softmax((mm(q, ke.transpose(-1, -2)) * scale).masked_fill(future, float("-inf")), dim=-1)
    out = mm(p, ve)
    d_out = d_out.to(dtype).float()
    dp = mm(d_out, ve.transpose(-1, -2))
    ds = p * (dp - (d_out * out).sum(-1, keepdim=True))
    dk, dv = mm(ds.transpose(-1, -2), q) * scale, mm(p.transpose(-1, -2), d_out)
    B, H, _, D = q.shape
    return {"out": out, "dq": mm(ds, ke) * scale,  # a KV head's gradient: the sum over its query heads
            "dk": dk.view(B, H // groups, groups, S, D).sum(2), "dv": dv.view(B, H // groups, groups, S, D).sum(2)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_reference_is_torch_attention_and_its_autograd():
    q, k, v, d_out = (x.double() for x in W.inputs())
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(d_out)
    ref = reference(*(x.detach().float() for x in (q, k, v, d_out)), torch.float32)
    # fp32 throughout: sums of S = 64 terms and a softmax, well inside 1e-5 relative (u_fp32 = 6e-8).
    for name, want in {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        assert rel(ref[name], want) < 1e-5, name


def test_ring_fp32_equals_the_reference(ring):
    ref = reference(*W.inputs(), torch.float32)
    for name in ("out", "dq", "dk", "dv"):
        assert ring["fp32"][name].dtype == torch.float32
        assert rel(ring["fp32"][name], ref[name]) < 1e-5, name


def test_ring_bf16_forward_and_backward_round_like_the_reference(ring):
    ref16, ref32 = reference(*W.inputs(), torch.bfloat16), reference(*W.inputs(), torch.float32)
    got = ring["autocast"]
    for name, bound in (("out", 2.0), ("dq", 2.0), ("dk", 2.0), ("dv", 0.25)):
        m = rel(ref16[name], ref32[name])  # what rounding the matmul inputs to bf16 does to this result
        assert m > 2**-8 / 8, (name, m)  # the rounding is there (u_bf16 = 2^-8), so the bound is not fp32 noise
        assert got[name].dtype == torch.float32
        assert rel(got[name], ref16[name]) < bound * m, (name, rel(got[name], ref16[name]) / m)
        assert rel(got[name], ref32[name]) > m / 4, name  # and the ring did round: it is not the fp32 result


def test_bf16_tensors_and_autocast_give_the_same_ring(ring):
    """The compute dtype is autocast's or the tensors' own: the same roundings either way. Under autocast
    the fp32 inputs get fp32 results, which round to exactly the bf16 tensors' results."""
    for name in ("out", "dq", "dk", "dv"):
        assert ring["bf16"][name].dtype == torch.bfloat16 and ring["autocast"][name].dtype == torch.float32
        assert torch.equal(ring["autocast"][name].bfloat16(), ring["bf16"][name]), name


@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
def test_each_hop_sends_kv_heads_in_the_compute_dtype(ring, precision):
    B, H, K, S, D = ring["shape"]
    cp, local = ring["cp"], S // ring["cp"]
    element = 4 if precision == "fp32" else 2  # K/V in the compute dtype
    kv_hop = 2 * K * D * local * B * element  # not 2 * H * ...: the KV heads travel, expanded on arrival
    for sends in ring[precision]["sends"]:  # every rank
        assert {s["dim"] for s in sends} == {"cp"}
        fwd = [s["elements"] * s["element_size"] for s in sends if not s["backward"]]
        assert fwd == [kv_hop] * (cp - 1)
        # Backward: K/V travel again (cp - 1 hops), and their fp32 gradient accumulators dK, dV make cp
        # hops (the last one home).
        bwd = sorted(s["elements"] * s["element_size"] for s in sends if s["backward"])
        dkv_hop = 2 * K * D * local * B * 4
        assert bwd == sorted([kv_hop] * (cp - 1) + [dkv_hop] * cp)
    assert ring[precision]["other"] == []  # no collective besides the ring's sends
