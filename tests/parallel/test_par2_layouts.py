"""Pipeline, context and expert parallel layouts, alone and composed with tensor parallel and ZeRO-1
(the seed's dp=2 x tp=2 x pp=2 mesh with ZeRO-1; tp x cp; tp x ep; FSDP x pp), give the same
training as one process on the same global batch (CPU, gloo, fp32, 5 steps): losses within 1e-5
relative under AdamW, weights within 1e-5 under SGD. Every layout of one world size runs in one torchrun launch (par2_worker.py); the
one-process references run in this process through the same Trainer.

Also measured: the pipeline bubble (each stage's idle fraction, from the order its passes ran in,
replayed with fixed pass costs; the timed figure is printed) and the peak number of micro-batches in
flight per stage, against the closed forms; the ring's computed tiles against the
zigzag tile count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.trainer_data import VOCAB, byte_tokens  # noqa: F401  (the fixture)
from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from trainer.parallel.context_parallel import tile_counts
from trainer.parallel.pipeline_formulas import bubble_formula, expected_peak_in_flight

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("par2_worker.py")
STEPS = 5
DENSE = {"vocab_size": VOCAB, "dim": 32, "n_layers": 8, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32}
MOE = {**DENSE, "n_layers": 2, "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": None, "balance": "aux_loss"}}
MOE_BIAS = {**MOE, "moe": {**MOE["moe"], "balance": "bias", "bias_update_rate": 0.01}}


def config(model: dict, optimizer: str, world: int = 1, steps: int = STEPS, global_batch: int = 8,
           precision: str = "fp32", **parallel) -> dict:
    base = {
        "name": "par2-test", "seed": 0, "model": model, "tokenizer": {"vocab_size": VOCAB},
        "parallel": {"nproc_per_node": world, **parallel},
        "infra": {"health_check": False},
        "pretrain": {"steps": steps, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": global_batch,
                     "lr": 3e-3 if optimizer == "adamw" else 0.3, "warmup_steps": 1, "precision": precision,
                     "peak_flops": 1e11, "optimizer": optimizer, "grad_clip": 1.0},
    }
    return LifecycleConfig.model_validate(base).model_dump(mode="json")


def write_job(tmp: Path, tokens: Path, name: str, cfg: dict) -> Path:
    spec = JobSpec(job_id=name, stage="pretrain", config=cfg, inputs={"tokens": str(tokens)},
                   output=str(tmp / name / "out"), workdir=str(tmp / name / "work"))
    return spec.write(tmp / f"{name}.yaml")


def reference(tmp: Path, tokens: Path, name: str, cfg: dict) -> dict:
    """One process, same Trainer, same global batch."""
    from par2_worker import run

    out = tmp / f"{name}.ref.pt"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched ranks run (OMP_NUM_THREADS=1); tiny matmuls gain nothing from more
    try:
        run(str(write_job(tmp, tokens, f"ref-{name}", cfg)), "train", out)
    finally:
        torch.set_num_threads(threads)
    return torch.load(out)


def launch(tmp: Path, tokens: Path, world: int, layouts: dict[str, tuple[dict, str]]) -> dict[str, list[dict]]:
    """Run every layout (name -> (config, mode)) in one torchrun launch; returns name -> per-rank records."""
    plan = [{"name": n, "job": str(write_job(tmp, tokens, n, c)), "mode": m} for n, (c, m) in layouts.items()]
    plan_file = tmp / f"plan{world}.json"
    plan_file.write_text(json.dumps(plan))
    out = tmp / f"out{world}"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKER.parent}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(WORKER), str(plan_file), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return {n: [torch.load(out / f"{n}.rank{r}.pt") for r in range(world)] for n in layouts}


def replayed_idle(orders: list[list[tuple[str, int, int]]], v: int) -> list[float]:
    """Each rank's idle fraction when its passes run in the recorded order with fixed costs (forward 1,
    backward 2 per whole-model chunk, divided by the v chunks a rank holds; an input-only backward and
    its weight pass 1 each), a pass starting once its rank is free and its inputs exist: the forward of
    stage s waits for stage s-1's, the backward of s for stage s+1's. Over the whole step's span."""
    last = max(s for order in orders for _, s, _ in order)
    split = {(s, m) for order in orders for k, s, m in order if k == "W"}
    cost = {"F": 1.0 / v, "W": 1.0 / v}
    done: dict[tuple[str, int, int], float] = {}
    free, pos, busy = [0.0] * len(orders), [0] * len(orders), [0.0] * len(orders)
    while any(p < len(o) for p, o in zip(pos, orders)):
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, m = order[pos[r]]
                needs = {"F": [("F", s - 1, m)] if s > 0 else [],
                         "B": [("F", s, m)] + ([("B", s + 1, m)] if s < last else []),
                         "W": [("B", s, m)]}[kind]
                if any(n not in done for n in needs):
                    break
                c = (1.0 if (s, m) in split else 2.0) / v if kind == "B" else cost[kind]
                start = max([free[r]] + [done[n] for n in needs])
                done[(kind, s, m)] = free[r] = start + c
                busy[r] += c
                pos[r] += 1
                moved = True
        assert moved, f"the recorded orders deadlock: {[o[p] for p, o in zip(pos, orders) if p < len(o)]}"
    span = max(free)
    return [1.0 - b / span for b in busy]


def merged_state(records: list[dict]) -> dict[str, torch.Tensor]:
    """The full model from every rank's part; replicated parameters must agree across ranks."""
    state: dict[str, torch.Tensor] = {}
    for rec in records:
        for k, v in rec["state"].items():
            if k in state:
                torch.testing.assert_close(v, state[k], rtol=0, atol=1e-6, msg=f"replicas disagree on {k}")
            else:
                state[k] = v
    return state


def assert_close_losses(rec: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(rec["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=1e-4, atol=1e-6)
    # every rank reports every layer's activation statistics over the global batch, as one process does
    assert rec["acts"].keys() == ref["acts"].keys() and len(ref["acts"]) == 2 * ref["n_layers"]
    for k, want in ref["acts"].items():
        assert abs(rec["acts"][k] - want) <= 1e-4 * want, (k, rec["acts"][k], want)


def assert_same_training(records: list[dict], ref_adamw: dict, sgd_records: list[dict], ref_sgd: dict) -> None:
    for rec in records:  # every rank reports the global loss
        assert_close_losses(rec, ref_adamw)
    torch.testing.assert_close(torch.tensor(sgd_records[0]["losses"]), torch.tensor(ref_sgd["losses"]), rtol=1e-5, atol=0)
    state, want = merged_state(sgd_records), ref_sgd["state"]
    assert state.keys() == want.keys()
    for k, w in want.items():
        torch.testing.assert_close(state[k], w, rtol=0, atol=1e-5, msg=k)
    assert ref_adamw["losses"][-1] < ref_adamw["losses"][0]


PP2 = {  # name -> parallel settings (world 2)
    "pp2-gpipe": dict(pp=2, pp_schedule="gpipe"),
    "pp2-1f1b-uneven": dict(pp=2, pp_schedule="1f1b", pp_split=[5, 3]),
    "pp2-interleaved": dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
    "pp2-zbv": dict(pp=2, pp_schedule="zbv", pp_virtual_stages=2),
    "pp2-interleaved-zb": dict(pp=2, pp_schedule="interleaved_zb", pp_virtual_stages=2),
    "pp2-dualpipev": dict(pp=2, pp_schedule="dualpipev", pp_virtual_stages=2),
}
CP2 = {"cp2-ring": dict(cp=2, cp_impl="ring"), "cp2-ulysses": dict(cp=2, cp_impl="ulysses")}
BF16_WORLD2 = ["pp2-1f1b-uneven", "pp2-interleaved", "cp2-ring", "cp2-ulysses", "ep2"]


def relative_distance(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().div(torch.tensor(b).abs()).max())


@pytest.mark.distributed
@pytest.mark.slow
def test_world2_layouts_match_one_process(byte_tokens, tmp_path):
    layouts = {}
    for opt in ("adamw", "sgd"):
        for name, par in {**PP2, **CP2}.items():
            layouts[f"{name}-{opt}"] = (config(DENSE, opt, world=2, **par), "train")
        layouts[f"ep2-{opt}"] = (config(MOE, opt, world=2, dp=2, ep=2), "train")
    for name in BF16_WORLD2:  # the same layouts with bf16 weights and fp32 masters, AdamW
        par = {**PP2, **CP2, "ep2": dict(dp=2, ep=2)}[name]
        layouts[f"{name}-bf16"] = (config(MOE if name == "ep2" else DENSE, "adamw", world=2, precision="bf16", **par),
                                   "train")
    got = launch(tmp_path, byte_tokens, 2, layouts)
    ref = {(m, opt): reference(tmp_path, byte_tokens, f"{m}-{opt}", config(model, opt))
           for m, model in (("dense", DENSE), ("moe", MOE)) for opt in ("adamw", "sgd")}
    for m, model in (("dense", DENSE), ("moe", MOE)):
        ref[m, "bf16"] = reference(tmp_path, byte_tokens, f"{m}-bf16", config(model, "adamw", precision="bf16"))
    failures = []
    for name in [*PP2, *CP2, "ep2"]:
        kind = "moe" if any(part.startswith("ep") for part in name.split("-")) else "dense"
        try:
            assert_same_training(got[f"{name}-adamw"], ref[kind, "adamw"], got[f"{name}-sgd"], ref[kind, "sgd"])
        except AssertionError as e:
            failures.append(f"{name}: {str(e)[:600]}")
    # bf16 parity, as tests/parallel/test_par1_layouts.py argues it: within bf16's epsilon of one process
    # in bf16 (measured: pp 2.1e-5, ring 2.3e-4, Ulysses 1.5e-5, ep 1.5e-5), and really in bf16 (away
    # from fp32 by more than 1/100 of one process's own bf16-vs-fp32 distance).
    for name in BF16_WORLD2:
        kind = "moe" if name == "ep2" else "dense"
        one, one_bf16 = ref[kind, "adamw"]["losses"], ref[kind, "bf16"]["losses"]
        m = relative_distance(one_bf16, one)
        for rec in got[f"{name}-bf16"]:
            d = relative_distance(rec["losses"], one_bf16)
            if not (d <= torch.finfo(torch.bfloat16).eps and relative_distance(rec["losses"], one) > m / 100):
                failures.append(f"{name}-bf16: {d:.3g} from one process in bf16 (m = {m:.3g})")
    assert not failures, "\n".join(failures)
    # The uneven split is the configured one; auto puts fewer layers on the head's stage.
    assert [r["counts"] for r in got["pp2-1f1b-uneven-adamw"]][0] == [5, 3]
    auto = got["pp2-gpipe-adamw"][0]["counts"]
    assert sum(auto) == 8 and auto[1] <= auto[0]
    # V-shape: rank 0 holds the first and the last chunk.
    assert got["pp2-zbv-adamw"][0]["chunks"] == [0, 3]
    # The ring computed exactly the zigzag tiles: per layer and micro-batch forward, tile_counts(cp)[rank].
    per_forward = tile_counts(2)
    for r, rec in enumerate(got["cp2-ring-adamw"]):
        forwards = STEPS * 4 * DENSE["n_layers"]  # steps x micro-batches x layers
        assert rec["tiles"] == forwards * per_forward[rec["cp_rank"]]
    # Expert parallel: each rank holds half the experts; no token dropped; the load statistics are logged.
    ep = got["ep2-adamw"]
    assert {k for k in ep[0]["state"] if ".experts." in k}.isdisjoint({k for k in ep[1]["state"] if ".experts." in k})
    assert ep[0]["moe"]["moe_dropped"] == 0.0 and ep[0]["moe"]["moe_imbalance"] >= 1.0


@pytest.mark.distributed
@pytest.mark.slow
def test_world4_layouts_and_pipeline_bubble(byte_tokens, tmp_path):
    layouts = {}
    for opt in ("adamw", "sgd"):
        layouts[f"pp4-interleaved-{opt}"] = (config(DENSE, opt, world=4, pp=4, pp_schedule="interleaved_1f1b",
                                                    pp_virtual_stages=2), "train")
        layouts[f"cp4-ring-{opt}"] = (config(DENSE, opt, world=4, cp=4), "train")
        layouts[f"ep4-{opt}"] = (config(MOE_BIAS, opt, world=4, dp=4, ep=4), "train")
        # ep=2 inside dp=4: every expert on two ranks, its gradient summed over that pair only.
        layouts[f"ep2-dp4-{opt}"] = (config(MOE_BIAS, opt, world=4, dp=4, ep=2), "train")
        # Heads over tp, sequence over cp (ring attention on the local heads); ZeRO-1 over the cp ranks,
        # which hold the same weights (DDP does not take tensor-parallel DTensors).
        layouts[f"tp2-cp2-zero1-{opt}"] = (config(DENSE, opt, world=4, tp=2, cp=2, zero=1), "train")
    # AdamW only: MoE layers whole on every tp rank (attention and the rest split over tp, sequence
    # parallel) with their experts over ep=2 and ZeRO-1 beside it (experts keep whole moments); FSDP
    # (ZeRO-3) inside an interleaved pipeline.
    layouts["tp2-ep2-dp2-zero1-sp-adamw"] = (config(MOE_BIAS, "adamw", world=4, tp=2, dp=2, ep=2, zero=1,
                                                    sequence_parallel=True), "train")
    layouts["dp2-pp2-zero3-adamw"] = (config(DENSE, "adamw", world=4, dp=2, pp=2, zero=3,
                                             pp_schedule="interleaved_1f1b", pp_virtual_stages=2), "train")
    # Bubble: m = 8 micro-batches on p = 4 stages, fixed pass delays (forward 20 ms, backward 40 ms).
    bubble = {"gpipe": {}, "1f1b": {}, "interleaved_1f1b": {"pp_virtual_stages": 2}}
    for sched, extra in bubble.items():
        layouts[f"bubble-{sched}"] = (config(DENSE, "adamw", world=4, steps=3, global_batch=16, pp=4,
                                             pp_schedule=sched, **extra), "bubble")
    got = launch(tmp_path, byte_tokens, 4, layouts)
    ref = {(m, opt): reference(tmp_path, byte_tokens, f"{m}-{opt}", config(model, opt))
           for m, model in (("dense", DENSE), ("moe", MOE_BIAS)) for opt in ("adamw", "sgd")}
    failures = []
    for name in ("pp4-interleaved", "cp4-ring", "ep4", "ep2-dp4", "tp2-cp2-zero1"):
        kind = "moe" if any(part.startswith("ep") for part in name.split("-")) else "dense"
        try:
            assert_same_training(got[f"{name}-adamw"], ref[kind, "adamw"], got[f"{name}-sgd"], ref[kind, "sgd"])
        except AssertionError as e:
            failures.append(f"{name}: {str(e)[:600]}")
    for name in ("tp2-ep2-dp2-zero1-sp", "dp2-pp2-zero3"):
        kind = "moe" if any(part.startswith("ep") for part in name.split("-")) else "dense"
        for rec in got[f"{name}-adamw"]:
            try:
                assert_close_losses(rec, ref[kind, "adamw"])
            except AssertionError as e:
                failures.append(f"{name}: {str(e)[:600]}")
    assert not failures, "\n".join(failures)
    # ZeRO-1 with expert parallel: the dense weights' moments are sharded over dp, the experts' are whole.
    for rec in got["tp2-ep2-dp2-zero1-sp-adamw"]:
        experts = sum(v.numel() for k, v in rec["state"].items() if ".experts." in k)
        assert 8 * experts < rec["state_bytes"] < 8 * rec["local_params"]
    for rec in got["tp2-cp2-zero1-adamw"]:
        assert rec["tiles"] == STEPS * 4 * DENSE["n_layers"] * tile_counts(2)[rec["cp_rank"]]
    # Validation through the pipeline equals the one-process validation loss.
    assert got["pp4-interleaved-sgd"][0]["val_loss"] == pytest.approx(ref["dense", "sgd"]["val_loss"], rel=1e-5)
    for r, rec in enumerate(got["cp4-ring-adamw"]):
        assert rec["tiles"] == STEPS * 4 * DENSE["n_layers"] * tile_counts(4)[rec["cp_rank"]]
    # The routing bias moved identically to one process (it is in the state compared above).
    assert ref["moe", "sgd"]["state"]["layers.0.mlp.expert_bias"].abs().sum() > 0

    p, m = 4, 8
    figures = {}
    for sched in bubble:
        recs = sorted(got[f"bubble-{sched}"], key=lambda r: r["pp_rank"])
        timed = [sum(r["idle"]) / len(r["idle"]) for r in recs]
        v = 2 if sched.startswith("interleaved") else 1
        want = bubble_formula(p, m, v)
        # The bubble is asserted on the order the ranks ran their passes in (the schedule itself), replayed
        # with fixed costs: the timed idle also carries the machine's load (4 ranks on 2 busy cores moved
        # it up to 0.07 off the formula, and interleaved/1f1b from 0.62 up to 0.92, so a timed 0.8 bound
        # was a coin flip). The timed figure is printed for the record, as benchmarks/ would.
        for step, orders in enumerate(zip(*(r["orders"] for r in recs))):
            idle = replayed_idle(list(orders), v)
            assert abs(sum(idle) / p - want) < 1e-6, (sched, step, idle, want)
        figures[sched] = sum(idle) / p
        print(json.dumps({"figure": "pipeline_bubble", "schedule": sched, "p": p, "m": m, "v": v,
                          "timed_idle_per_stage": [round(x, 3) for x in timed], "replayed": round(figures[sched], 3),
                          "formula": round(want, 3), "peak_in_flight": [r["peak_live"] for r in recs]}))
        assert all(0.0 <= x < 1.0 for x in timed), timed
        if sched != "interleaved_1f1b":
            for i, r in enumerate(recs):  # one chunk per rank: chunk id == stage id == pp rank
                assert r["peak_live"][i] == expected_peak_in_flight(sched, p, m, i), (sched, i, r["peak_live"])
    # Interleaving shrinks the bubble (Narayanan et al. 2021: divided by v): 3/19 against 3/11 here.
    assert figures["interleaved_1f1b"] < 0.8 * figures["1f1b"]


@pytest.mark.distributed
@pytest.mark.slow
def test_world8_meshes_match_one_process(byte_tokens, tmp_path):
    """The seed's 2 x 2 x 2 mesh on the tiny model, as configs/seed-1b.yaml lays it out: dp=2 x tp=2 (+
    sequence parallel) x pp=2 with ZeRO-1 over dp, 1F1B, 4 micro-batches of 2 per replica and an uneven
    split (fewer layers on the head's stage); and dp=2 x cp=2 x pp=2 with zero=0 (the pipeline step
    averages the data-parallel gradients itself)."""
    layouts = {}
    for opt in ("adamw", "sgd"):
        layouts[f"dp2-tp2-pp2-{opt}"] = (config(DENSE, opt, world=8, global_batch=16, dp=2, tp=2, pp=2, zero=1,
                                                sequence_parallel=True, pp_schedule="1f1b", pp_split=[5, 3]),
                                         "train")
    # dp x cp x pp under SGD only (losses and weights), to keep the launch short.
    layouts["dp2-cp2-pp2-sgd"] = (config(DENSE, "sgd", world=8, dp=2, cp=2, pp=2, pp_schedule="1f1b"), "train")
    got = launch(tmp_path, byte_tokens, 8, layouts)
    ref_cfg = {opt: config(DENSE, opt, global_batch=16) for opt in ("adamw", "sgd")}
    # Validation deals eval_batches per dp rank: one process sees the same rows with twice as many.
    ref_cfg["adamw"]["pretrain"]["eval_batches"] *= 2
    ref = {opt: reference(tmp_path, byte_tokens, f"dense16-{opt}", ref_cfg[opt]) for opt in ("adamw", "sgd")}
    assert_same_training(got["dp2-tp2-pp2-adamw"], ref["adamw"], got["dp2-tp2-pp2-sgd"], ref["sgd"])
    seed = got["dp2-tp2-pp2-adamw"]
    assert seed[0]["counts"] == [5, 3]
    # ZeRO-1: each dp rank holds the moments of half of its stage's (tp-local) parameters.
    by_pos: dict[tuple[int, int], list[dict]] = {}
    for rec in seed:
        by_pos.setdefault((rec["pp_rank"], rec["tp_rank"]), []).append(rec)
    for pair in by_pos.values():  # the two dp ranks' segments partition the stage's elements: 2 fp32 moments each
        assert len(pair) == 2 and sum(r["state_bytes"] for r in pair) == 2 * 4 * pair[0]["local_params"]
        assert all(0.4 < r["state_bytes"] / (8 * r["local_params"]) < 0.6 for r in pair)
    # Validation through the pipeline under sequence parallel (1/tp of the sequence between stages).
    assert seed[0]["val_loss"] == pytest.approx(ref["adamw"]["val_loss"], rel=1e-5)
    ref8 = reference(tmp_path, byte_tokens, "dense8-sgd", config(DENSE, "sgd"))
    assert_same_training(got["dp2-cp2-pp2-sgd"], ref8, got["dp2-cp2-pp2-sgd"], ref8)
    assert {(r["dp_rank"], r["cp_rank"], r["pp_rank"]) for r in got["dp2-cp2-pp2-sgd"]} == {
        (d, c, q) for d in range(2) for c in range(2) for q in range(2)}
