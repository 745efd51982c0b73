"""`pretrain.precision: fp8` (trainer/precision.py): the config's checks, the one-line refusal on a device
without FP8 tensor cores, and the swap to torchao's Float8Linear on the intended layers (on CPU through
torchao's emulated float8, `fp8.emulate`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from fixtures.trainer_data import tiny_config
from infra.launch.job import JobSpec
from trainer.data import MicroBatch
from trainer.estimate import count_model_flops
from trainer.meta_init import build_model
from trainer.objectives import LanguageModelling
from trainer.optim import build_optimizer
from trainer.parallel import build_parallel_dims, parallelize
from trainer.precision import check_fp8_device
from trainer.step import train_step

pytest.importorskip("torchao")


def test_config_accepts_fp8_and_checks_its_options():
    cfg = tiny_config(precision="fp8", fp8={"recipe": "rowwise"})
    assert cfg.pretrain.precision == "fp8" and cfg.pretrain.fp8.skip == ["lm_head", "mlp.gate"]
    with pytest.raises(ValidationError, match="recipe"):
        tiny_config(precision="fp8", fp8={"recipe": "blockwise"})
    with pytest.raises(ValidationError, match="not layer names"):
        tiny_config(precision="fp8", fp8={"skip": ["lm_head", ""]})
    with pytest.raises(ValidationError, match="emulate runs eagerly"):
        tiny_config(precision="fp8", compile=True, fp8={"emulate": True})
    d = tiny_config(precision="fp8").model_dump(mode="json")
    d["parallel"].update(tp=2, nproc_per_node=2)
    with pytest.raises(ValidationError, match="precision=fp8 with parallel.tp=2"):
        type(cfg).model_validate(d)


def test_refused_on_cpu_in_one_line_before_the_job_touches_its_inputs(tmp_path):
    with pytest.raises(RuntimeError) as info:
        check_fp8_device(torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message and "precision=fp8 refused" in message and "cpu has no FP8 tensor cores" in message
    check_fp8_device(torch.device("cpu"), emulate=True)  # the tests' escape hatch is not refused

    from trainer.trainer import Trainer

    cfg = tiny_config(precision="fp8").model_dump(mode="json")
    spec = JobSpec(job_id="fp8", stage="pretrain", config=cfg, inputs={"tokens": str(tmp_path / "absent")},
                   output=str(tmp_path / "out"), workdir=str(tmp_path / "work"))
    with pytest.raises(RuntimeError, match="cpu has no FP8 tensor cores"):  # not the missing tokens folder
        Trainer(spec)


def _moe_config(precision: str):
    cfg = tiny_config(precision=precision, fp8={"emulate": True})
    d = cfg.model_dump(mode="json")
    d["model"]["moe"] = {"num_experts": 2, "top_k": 1}
    d["model"]["ffn_dim"] = 120  # not a multiple of 16: the experts' layers stay bf16 as well
    return type(cfg).model_validate(d)


def test_swap_hits_the_intended_layers_and_the_step_stays_close_to_bf16():
    from torchao.float8.float8_linear import Float8Linear

    dims = build_parallel_dims(tiny_config().parallel, "cpu")
    models = {}
    for precision in ("bf16", "fp8"):
        cfg = _moe_config(precision)
        models[precision] = parallelize(build_model(cfg), dims, cfg.parallel, cfg.pretrain,
                                        device=torch.device("cpu"), seed=0)
    fp8 = models["fp8"]
    converted = {n for n, m in fp8.named_modules() if isinstance(m, Float8Linear)}
    # attention's four projections in each block; not the LM head, the router (mlp.gate: 2 outputs) or
    # the experts (ffn 120)
    expected = {f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"}
    assert converted == expected
    assert isinstance(fp8.layers["0"].mlp.experts[0].up_proj, torch.nn.Linear)
    for (name, a), (_, b) in zip(models["bf16"].named_parameters(), fp8.named_parameters()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name  # same names, weights, dtype

    # the FLOPs torch counts (the trainer's measured.flops_per_step beside the estimate) are bf16's
    rows = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        counted = {p: count_model_flops(m, (rows[:, :-1], rows[:, 1:])) for p, m in models.items()}
    assert counted["fp8"] == counted["bf16"] > 0

    cfg = _moe_config("bf16")
    rows = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    batch = [MicroBatch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), np.arange(4))]
    losses = {}
    for precision, model in models.items():
        train = _moe_config(precision).pretrain
        losses[precision] = train_step(model, build_optimizer(model, train), batch, LanguageModelling(), train, 0,
                                       torch.device("cpu")).loss
    # float8 rounds the attention matmuls' operands (e4m3: 3 mantissa bits): close to bf16, not equal
    assert losses["fp8"] != losses["bf16"]
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.02)
