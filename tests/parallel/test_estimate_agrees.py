"""The estimator describes the trainer (DESIGN: "state bytes per rank and wire bytes per step, measured by
benchmarks/parallel_layouts.py, equal eightfold estimate's for every layout"): the benchmark's measuring
function on small 2-rank layouts (tiny model, one counted step), in bf16 and fp32, against
trainer/estimate's figures for the same config, within 1%.

Also the seed's own numbers: ZeRO-1 over dp=2 in bf16 holds 2 + 2 + 12/2 bytes per parameter (its
gradient shards named apart), ZeRO-3 16/2; DDP moves the gradient once at 2 bytes a value in bf16 (4 in
fp32), ZeRO-1 exactly as much and ZeRO-3 1.5x."""

from __future__ import annotations

import pytest

from benchmarks.parallel_layouts import config, parser, run_layouts
from trainer.estimate.formulas import param_counts

LAYOUTS = ["ddp2", "zero1_dp2", "zero3_dp2", "tp2_sp", "pp2_1f1b", "cp2_ring"]


def args(precision: str):
    return parser().parse_args(["--dim", "32", "--layers", "2", "--seq", "32", "--batch", "4", "--micro", "2",
                                "--steps", "0", "--precision", precision])


@pytest.fixture(scope="module", params=["bf16", "fp32"])
def rows(request):
    a = args(request.param)
    return request.param, a, {r["layout"]: r for r in run_layouts(LAYOUTS, a)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_bytes_per_rank_equal_the_estimate(rows, layout):
    _, _, by = rows
    r = by[layout]
    assert r["state_bytes_rank0"] > 0
    assert r["state_bytes_rank0"] == pytest.approx(r["estimated_state_bytes_rank0"], rel=0.01)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wire_bytes_per_step_equal_the_estimate(rows, layout):
    precision, _, by = rows
    r = by[layout]
    measured, estimated = r["wire_bytes_per_step"], r["estimated_wire_bytes_per_step"]
    assert estimated and set(estimated) <= set(measured)  # every group the estimate names carried bytes
    differs = {k: (measured[k], estimated[k]) for k in estimated
               if measured[k] != pytest.approx(estimated[k], rel=0.01)}
    assert not differs, f"{layout} {precision}: measured, estimated {differs}"
    # Groups the estimate leaves out carry only scalars (token counts, gradient norms): under 1% of the total.
    assert sum(v for k, v in measured.items() if k not in estimated) < 0.01 * sum(estimated.values())


def test_seed_bytes_per_parameter_and_traffic(rows):
    precision, a, by = rows
    n = param_counts(config("ddp2", a).model)["total"]
    zero1 = by["zero1_dp2"]
    per_param = {k: v / n for k, v in zero1["state_breakdown_rank0"].items()}
    if precision == "bf16":  # 2 (bf16 weight) + 2 (bf16 gradient) + (4 + 4 + 4) / 2
        assert per_param == pytest.approx({"weights": 2, "grads": 2, "masters": 2, "moments": 4}, rel=1e-3)
    else:  # fp32 parameters are their own masters: 4 + 4 + 8 / 2
        assert per_param == pytest.approx({"weights": 4, "grads": 4, "masters": 0, "moments": 4}, rel=1e-3)
    assert by["zero3_dp2"]["state_bytes_rank0"] / n == pytest.approx(16 / 2, rel=0.01)
    assert by["ddp2"]["state_bytes_rank0"] / n == pytest.approx(16, rel=0.01)
    wire = {k: sum(by[k]["wire_bytes_per_step"].values()) for k in ("ddp2", "zero1_dp2", "zero3_dp2")}
    value = 2 if precision == "bf16" else 4
    assert wire["ddp2"] == pytest.approx(n * value, rel=0.01)  # all-reduce of the gradient: 2(d-1)/d = 1
    assert wire["zero1_dp2"] / wire["ddp2"] == pytest.approx(1, rel=0.01)  # "equals one all-reduce"
    assert wire["zero3_dp2"] / wire["ddp2"] == pytest.approx(1.5, rel=0.01)  # "1.5x"
