"""Communication overlapped with compute, proved by the order of events on CPU (gloo), not only by the
result (overlap_worker.py logs gradients, collectives, forwards, backward passes and waits as they happen):

- ZeRO-1 reduce-scatters a bucket right after its last gradient of the step's last micro-batch, so the
  last layers' buckets are on the wire while backward still computes the first layer (seed: "overlap
  starts all-reducing the last layers' bucket while backward is still computing earlier layers");
  nothing moves during the earlier micro-batches.
- ZeRO-1's all-gathers are all issued before the next step begins, and the next forward waits for each
  bucket only at the unit that first uses it.
- Under pipeline parallel a stage's buckets (ZeRO-1's reduce-scatters, zero=0's all-reduces) start
  inside its last backward pass, before the schedule has finished.
- Overlapped and non-overlapped runs train bit for bit the same (fp32, bf16, bf16 with fp32 gradient
  accumulation, pipeline), and the non-overlapped runs show the other order, so the order assertions can fail.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
WORLD2 = ["zero1", "zero1_off", "zero1_bf16", "zero1_bf16_off", "zero1_fp32acc", "zero1_fp32acc_off"]
WORLD4 = ["pp_zero1", "pp_zero1_off", "pp_zero0", "pp_zero0_off"]
BIG = 256  # gradient and weight buckets, not the loop's scalar sums

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch(tmp: Path, nproc: int, names: list[str]) -> list[dict]:
    out = tmp / f"overlap{nproc}.pt"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "overlap_worker.py"), str(out), *names]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("overlap"), 2, WORLD2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("overlap"), 4, WORLD4)


def step_events(events: list[tuple], step: int) -> list[tuple]:
    return events[events.index(("step", step)):events.index(("step", step + 1))]


def where(events: list[tuple], kind: str) -> list[int]:
    """Indices of the data-parallel gradient/weight collectives of `kind`."""
    return [i for i, e in enumerate(events)
            if e[0] == "collective" and e[1] == kind and e[2] == "dp" and e[3] >= BIG]


def unit_of(param: str) -> str:
    """The unit whose forward first uses a parameter (the LM head's: the final norm, see param_ready.py)."""
    if param.startswith("layers."):
        return ".".join(param.split(".")[:2])
    return "norm" if param.startswith(("norm.", "lm_head.")) else param.split(".")[0]


def test_zero1_reduce_scatters_during_the_last_backward(world2):
    for rank in world2:
        on, off = rank["zero1"], rank["zero1_off"]
        n = len(on["buckets"])
        assert n >= 8  # buckets of 0.02 MB: several per layer, so the order means something
        ev = step_events(on["events"], 1)
        micro = [i for i, e in enumerate(ev) if e == ("micro",)]
        assert len(micro) == on["n_micro"] == 2
        rs = where(ev, "reduce_scatter")
        assert len(rs) == n
        assert min(rs) > micro[-1]  # the earlier micro-batch only accumulates
        first_layer = min(i for i, e in enumerate(ev)
                          if i > micro[-1] and e[0] == "grad" and e[1].startswith("layers.0."))
        last_grad = max(i for i, e in enumerate(ev) if e[0] == "grad")
        assert ev[last_grad] == ("grad", "embed_tokens.weight")  # backward ends at the first layer's input
        # the last layers' buckets leave before backward reaches the first layer; only the embedding's waits for it
        assert min(rs) < first_layer
        assert sum(i < last_grad for i in rs) == n - 1
        # each one as soon as its last gradient is in: right after a gradient (or after another bucket's launch)
        assert all(ev[i - 1][0] == "grad" or i - 1 in rs for i in rs)
        # without overlap every reduce-scatter waits for the end of backward
        ev_off = step_events(off["events"], 1)
        assert min(where(ev_off, "reduce_scatter")) > max(i for i, e in enumerate(ev_off) if e[0] == "grad")


def test_zero1_gathers_before_the_next_forward_and_waits_per_bucket(world2):
    for rank in world2:
        on, off = rank["zero1"], rank["zero1_off"]
        n = len(on["buckets"])
        ev = step_events(on["events"], 1)
        ag = where(ev, "all_gather")
        assert len(ag) == n and min(ag) > max(where(ev, "reduce_scatter"))  # after the step, in this step
        assert not [e for e in ev[min(ag):] if e[0] in ("forward", "micro", "wait")]  # nothing waited yet
        nxt = step_events(on["events"], 2)
        waits = {e[1]: i for i, e in enumerate(nxt) if e[0] == "wait"}
        assert sorted(waits) == list(range(n)) and len([e for e in nxt if e[0] == "wait"]) == n
        first_grad = min(i for i, e in enumerate(nxt) if e[0] == "grad")
        assert max(waits.values()) < first_grad
        for b, i in waits.items():  # each bucket waited for where its first unit's forward begins
            unit = [e[1] for e in nxt[:i] if e[0] == "forward"][-1]
            assert unit == unit_of(on["buckets"][b][0]), (b, unit, on["buckets"][b])
        # so the first blocks ran before the last buckets were waited for
        assert waits[n - 1] > nxt.index(("forward", "layers.1"))
        # without overlap: all waited for in the step itself, none in the next forward
        off_ev = step_events(off["events"], 1)
        assert [i for i, e in enumerate(off_ev) if e[0] == "wait"][0] > max(where(off_ev, "all_gather"))
        off_next = step_events(off["events"], 2)
        assert not [e for e in off_next[:off_next.index(("grad", "lm_head.weight"))] if e[0] == "wait"]


def test_zero1_overlap_is_bit_identical(world2):
    for rank in world2:
        for case in ("zero1", "zero1_bf16", "zero1_fp32acc"):
            on, off = rank[case], rank[case + "_off"]
            assert on["losses"] == off["losses"], case
            assert on["state"].keys() == off["state"].keys()
            for k, v in on["state"].items():
                assert torch.equal(v, off["state"][k]), (case, k)
        assert rank["zero1"]["losses"] != rank["zero1_bf16"]["losses"]  # the cases do differ


def test_pipeline_reduces_during_each_stage_last_backward(world4):
    assert {r["pp_zero1"]["pp_rank"] for r in world4} == {0, 1}
    for rank in world4:
        for case, kind in (("pp_zero1", "reduce_scatter"), ("pp_zero0", "all_reduce")):
            on, off = rank[case], rank[case + "_off"]
            m = on["n_micro"]
            assert m == 4
            ev = step_events(on["events"], 1)
            start, end = ev.index(("backward", m - 1, "start")), ev.index(("backward", m - 1, "end"))
            assert end == max(i for i, e in enumerate(ev) if e[0] == "backward")  # the stage's last pass
            reductions = where(ev, kind)
            assert len(reductions) == len(on["buckets"]) >= 3, (case, on["buckets"])
            # counted over m backward passes: none before the last, all inside it
            assert all(start < i < end for i in reductions), (case, rank["pp_zero1"]["pp_rank"])
            ev_off = step_events(off["events"], 1)
            assert min(where(ev_off, kind)) > ev_off.index(("backward", m - 1, "end"))
            assert on["losses"] == off["losses"], case
            for k, v in on["state"].items():
                assert torch.equal(v, off["state"][k]), (case, k)
        # ZeRO-1 under the pipeline: the gathered weights are waited for in the next forward too
        nxt = step_events(rank["pp_zero1"]["events"], 2)
        waits = [i for i, e in enumerate(nxt) if e[0] == "wait"]
        assert len(waits) == len(rank["pp_zero1"]["buckets"]) and min(waits) > nxt.index(
            next(e for e in nxt if e[0] == "forward"))
