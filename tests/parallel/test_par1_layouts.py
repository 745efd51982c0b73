"""Parallel layouts I against one process (CPU, gloo, fp32, same global batch and seed, 5 steps):
DDP, ZeRO-1 (our distributed optimizer), ZeRO-2/3 and HSDP (FSDP2), TP, TP+SP and TP x ZeRO-1 give
the same losses under AdamW and the same weights under SGD; their collectives match the seed's
formulas; ZeRO-1 holds 1/d of the optimizer state. All layouts of one world size run in one torchrun
launch (par1_worker.py); the one-process reference runs in the test process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import par1_worker as W  # noqa: E402

PARITY = ["ddp2", "zero1_dp2", "zero1_dp4", "zero2_dp2", "zero3_dp4", "hsdp_2x2", "tp2", "tp2_sp", "tp2_zero1_dp2",
          "tp2_fsdp_dp2"]
# the model with MTP modules (2 depths) through DDP, ZeRO-1, FSDP (ZeRO-2) and TP+SP, against its own one process
MTP = [n + W.MTP for n in ("ddp2", "zero1_dp2", "zero2_dp2", "tp2_sp")]
BF16 = [n + W.BF16 for n in PARITY + ["zero1_dp2_fp32acc"]]  # every parity layout again in bf16
WORLD2 = ["ddp2", "zero1_dp2", "zero2_dp2", "tp2", "tp2_sp"] + [n for n in BF16 if W.world_of(n) == 2] + MTP
WORLD4 = ["ddp4", "zero1_dp4", "zero3_dp4", "hsdp_2x2", "tp2_zero1_dp2", "tp2_fsdp_dp2"] + \
    [n for n in BF16 if W.world_of(n) == 4]
L, B, S, H = 2, W.MICRO, W.SEQ, 48  # layers, micro-batch rows, sequence, model dim (par1_worker.config)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch(tmp: Path, names: list[str]) -> dict:
    nproc = W.world_of(names[0])
    assert all(W.world_of(n) == nproc for n in names)
    out = tmp / f"world{nproc}.pt"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "par1_worker.py"), str(out), *names]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("par1")
    torch.set_num_threads(1)
    out = W.run_all(["one", "one" + W.BF16, "one" + W.MTP])
    out.update(launch(tmp, WORLD2))
    out.update(launch(tmp, WORLD4))
    return out


def big(records: list[dict], min_elements: int = 256) -> list[dict]:
    """The gradient/parameter collectives (not the loop's scalar sums or the loss's [b, s] ones)."""
    return [r for r in records if r["elements"] >= min_elements]


def wire(records: list[dict]) -> float:
    return sum(r["wire_bytes"] for r in records)


@pytest.mark.parametrize("layout", PARITY + MTP)
def test_layout_matches_one_process(results, layout):
    reference = "one" + W.MTP if layout.endswith(W.MTP) else "one"
    one, par = results[reference], results[layout]
    # every collective is attributed to a named mesh dimension
    assert {r["dim"] for r in par["adamw"]["comm"]} <= {"dp", "dp_shard", "dp_replicate", "tp"}, layout
    ref = torch.tensor(one["adamw"]["losses"], dtype=torch.float64)
    assert len(ref) == W.STEPS and ref[-1] < ref[0]  # it learns, so equal losses are not trivially equal
    got = torch.tensor(par["adamw"]["losses"], dtype=torch.float64)
    assert ((got - ref).abs() / ref).max() < 1e-5, (layout, got.tolist(), ref.tolist())
    torch.testing.assert_close(torch.tensor(par["adamw"]["grad_norms"]), torch.tensor(one["adamw"]["grad_norms"]),
                               rtol=1e-4, atol=1e-6)
    # per-layer activation statistics over the global batch, whatever each rank holds of it
    assert par["adamw"]["acts"].keys() == one["adamw"]["acts"].keys() and len(one["adamw"]["acts"]) == 2 * L
    for k, want in one["adamw"]["acts"].items():
        assert abs(par["adamw"]["acts"][k] - want) <= 1e-4 * want, (layout, k, par["adamw"]["acts"][k], want)
    ref_sgd = torch.tensor(one["sgd"]["losses"], dtype=torch.float64)
    got_sgd = torch.tensor(par["sgd"]["losses"], dtype=torch.float64)
    assert ((got_sgd - ref_sgd).abs() / ref_sgd).max() < 1e-5
    w1, w2 = one["sgd"]["state"], par["sgd"]["state"]
    assert w1.keys() == w2.keys()
    for name, w in w1.items():
        assert w2[name].shape == w.shape, name
        torch.testing.assert_close(w2[name], w, rtol=0, atol=1e-5, msg=name)
    if layout.endswith(W.MTP):  # each depth's loss too, and the MTP weights are among those compared
        assert any(k.startswith("mtp.1.") for k in w1) and len(one["adamw"]["mtp"][0]) == 2
        for got_m, want_m in zip(par["adamw"]["mtp"], one["adamw"]["mtp"]):
            assert got_m.keys() == want_m.keys()
            for k, want in want_m.items():
                assert abs(got_m[k] - want) <= 1e-5 * want, (layout, k, got_m[k], want)
    init = W.build_model(W.config(reference, "sgd"), torch.device("cpu"), 0).state_dict()
    assert max((w - init[k]).abs().max().item() for k, w in w1.items()) > 1e-3  # moved far beyond the tolerance


def test_zero1_moves_the_bytes_of_one_ddp_all_reduce(results):
    """Seed: "The traffic equals one all-reduce" (reduce-scatter + all-gather)."""
    for dp in (2, 4):
        ddp = big(results[f"ddp{dp}"]["adamw"]["comm"])
        zero1 = big(results[f"zero1_dp{dp}"]["adamw"]["comm"])
        assert {r["kind"] for r in ddp} == {"all_reduce"}
        assert {r["kind"] for r in zero1} == {"reduce_scatter", "all_gather"}
        n = results["one"]["adamw"]["params"]
        assert sum(r["elements"] for r in ddp) == n
        # ZeRO-1 pads each bucket to a multiple of dp: at most dp-1 extra elements per bucket.
        rs = [r for r in zero1 if r["kind"] == "reduce_scatter"]
        assert n <= sum(r["elements"] for r in rs) <= n + len(rs) * (dp - 1)
        assert wire(zero1) == pytest.approx(wire(ddp), rel=len(rs) * dp / n)
        assert wire(ddp) == pytest.approx(2 * (dp - 1) / dp * n * 4)


def test_zero3_moves_one_and_a_half_ddp(results):
    """Seed: ZeRO-3 "costs 1.5x the traffic of plain data parallelism" (gather in forward, again in
    backward, reduce-scatter of gradients), here with one micro-batch per step. ZeRO-2 gathers once per
    step and keeps gradients sharded by reduce-scattering every micro-batch's (fsdp.py): with m = 2
    micro-batches it moves (m + 1)/2 = 1.5x DDP's all-reduce (one gather, two reduce-scatters), the
    estimator's formula."""
    from trainer.estimate.formulas import data_parallel_bytes

    assert results["zero3_dp4"]["adamw"]["n_micro"] == 1
    z3, ddp4 = big(results["zero3_dp4"]["adamw"]["comm"]), big(results["ddp4"]["adamw"]["comm"])
    assert wire(z3) / wire(ddp4) == pytest.approx(1.5, rel=1e-9)
    assert any(r["kind"] == "all_gather" and r["backward"] for r in z3)
    z2, ddp2 = big(results["zero2_dp2"]["adamw"]["comm"]), big(results["ddp2"]["adamw"]["comm"])
    m = results["zero2_dp2"]["adamw"]["n_micro"]
    assert m == 2
    assert wire(z2) / wire(ddp2) == pytest.approx((m + 1) / 2, rel=1e-9)
    n = results["one"]["adamw"]["params"]
    assert wire(z2) == pytest.approx(data_parallel_bytes(n, 2, 2, grad_bytes=4, weight_bytes=4, reductions=m))
    assert not any(r["kind"] == "all_gather" and r["backward"] for r in z2)
    gathers = [r for r in z2 if r["kind"] == "all_gather"]
    scatters = [r for r in z2 if r["kind"] == "reduce_scatter"]
    # every FSDP unit: gathered once per step, its gradient reduce-scattered in each micro-batch's backward
    assert len(scatters) == m * len(gathers) and all(r["backward"] for r in scatters)


def test_hsdp_shards_inside_and_reduces_across_replicas(results):
    recs = big(results["hsdp_2x2"]["adamw"]["comm"])
    by = {(r["kind"], r["dim"]) for r in recs}
    assert by == {("all_gather", "dp_shard"), ("reduce_scatter", "dp_shard"), ("all_reduce", "dp_replicate")}
    n = results["one"]["adamw"]["params"]
    # Across replicas only each shard's gradient (n / dp_shard) is all-reduced.
    assert sum(r["elements"] for r in recs if r["dim"] == "dp_replicate") == n // 2


def test_tensor_parallel_collectives(results):
    """TP: 2 all-reduces of [b, s, h] per layer per micro-batch in forward and 2 in backward (plus the
    vocab-parallel embedding's in forward and the LM head's input gradient in backward); the
    vocab-parallel cross-entropy only 3 all-reduces of [b, s]; nothing of the logits' size."""
    r = results["tp2"]["adamw"]
    micro, recs = r["n_micro"], r["comm"]
    act = [x for x in recs if x["elements"] == B * S * H]
    assert {x["kind"] for x in act} == {"all_reduce"} and {x["dim"] for x in act} == {"tp"}
    assert sum(not x["backward"] for x in act) == (2 * L + 1) * micro
    assert sum(x["backward"] for x in act) == (2 * L + 1) * micro
    loss = [x for x in recs if x["elements"] == B * S]
    assert len(loss) == 3 * micro and all(x["kind"] == "all_reduce" and not x["backward"] for x in loss)
    assert max(x["elements"] for x in recs) < B * S * W.VOCAB // 2  # full logits never communicated
    others = [x for x in recs if x not in act and x not in loss]  # norms, QK-norm gains' gradients
    assert all(x["elements"] < B * S for x in others), others


def test_sequence_parallel_swaps_all_reduce_for_reduce_scatter_and_all_gather(results):
    tp, sp = results["tp2"]["adamw"], results["tp2_sp"]["adamw"]
    micro = sp["n_micro"]
    act = [x for x in sp["comm"] if x["elements"] == B * S * H]
    assert not any(x["kind"] == "all_reduce" for x in act)
    for kind in ("all_gather", "reduce_scatter"):
        for backward in (False, True):
            n = sum(x["kind"] == kind and x["backward"] == backward for x in act)
            assert n == (2 * L + 1) * micro, (kind, backward, n)
    tp_act = [x for x in tp["comm"] if x["elements"] == B * S * H]
    assert wire(act) == pytest.approx(wire(tp_act))  # same bytes on the wire (seed)
    assert len([x for x in sp["comm"] if x["elements"] == B * S]) == 3 * micro


def test_zero1_optimizer_state_is_a_quarter_of_ddp_at_dp4(results):
    ddp = results["ddp4"]["adamw"]["state_bytes"]
    zero1 = results["zero1_dp4"]["adamw"]["state_bytes"]
    n = results["one"]["adamw"]["params"]
    assert ddp == 2 * 4 * n  # AdamW: two fp32 moments per parameter
    buckets = sum(1 for x in results["zero1_dp4"]["adamw"]["comm"] if x["kind"] == "reduce_scatter")
    # rank 0's shard of each bucket is ceil(numel / 4): within 3 elements (x 8 bytes) per bucket
    assert ddp / 4 <= zero1 <= ddp / 4 + buckets * 3 * 8
    assert results["zero3_dp4"]["adamw"]["state_bytes"] == ddp // 4  # FSDP: per-parameter shards


def test_fewer_kv_heads_than_tp_is_refused():
    from trainer.parallel.tensor_parallel import check_tp

    cfg = W.config("one", "adamw").model
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        check_tp(cfg, 4)
    check_tp(cfg, 2)


def bf16_distance(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().div(torch.tensor(b).abs()).max())


@pytest.mark.parametrize("layout", PARITY + ["zero1_dp2_fp32acc"])
def test_layout_in_bf16_tracks_one_process_bf16(results, layout):
    """bf16 parity: the layout with bf16 weights (FSDP: bf16 compute over fp32 shards) against one process
    in bf16, losses within bf16's epsilon (2^-7, relative). A layout sums in another order, and once an
    update rounds one weight the other way the runs part by about what bf16 rounding does: one process's
    own bf16-vs-fp32 distance m was 3.7e-4..8.7e-4 over 3 data seeds, the layouts' 1.4e-4..1.8e-3 (TP,
    whose matmuls split their sums, the largest): 77% of the bound left. The fp32 suite above is the exact
    check of each layout's mathematics; this one that bf16 weights, masters and wires train the same model.
    The layout must also really run in bf16: further than m / 100 from the fp32 losses."""
    one, one_bf16 = results["one"]["adamw"]["losses"], results["one_bf16"]["adamw"]["losses"]
    got = results[layout + W.BF16]["adamw"]["losses"]
    m = bf16_distance(one_bf16, one)
    assert all(torch.isfinite(torch.tensor(got))) and got[-1] < got[0]
    assert bf16_distance(got, one_bf16) <= torch.finfo(torch.bfloat16).eps, (got, one_bf16, m)
    assert bf16_distance(got, one) > m / 100


def test_bf16_weights_and_wire(results):
    """bf16 weights where the model holds them and bf16 on the wire: DDP's and ZeRO-1's gradient
    buckets and ZeRO-1's parameter all-gather carry 2 bytes per value; FSDP gathers bf16 from fp32 shards."""
    for name in ("ddp2", "zero1_dp2", "tp2_zero1_dp2"):
        grads = [r for r in big(results[name + W.BF16]["adamw"]["comm"]) if r["dim"] == "dp"]
        assert grads and all(r["element_size"] == 2 for r in grads), (name, grads)
    dims = {r["dim"] for r in results["tp2_fsdp_dp2_bf16"]["adamw"]["comm"]}
    assert {"tp", "dp"} <= dims


def test_fp32_grad_accum_reduces_in_fp32_and_gathers_bf16(results):
    """fp32_grad_accum (Megatron's grad_reduce_in_fp32): micro-batches sum in an fp32 buffer and ZeRO-1
    reduce-scatters it in fp32; the updated weights still all-gather in bf16."""
    dp = [r for r in big(results["zero1_dp2_fp32acc" + W.BF16]["adamw"]["comm"]) if r["dim"] == "dp"]
    sizes = {(r["kind"], r["element_size"]) for r in dp}
    assert ("reduce_scatter", 4) in sizes and ("all_gather", 2) in sizes, sizes
    assert not {k for k, size in sizes if size == 2} & {"reduce_scatter"}
