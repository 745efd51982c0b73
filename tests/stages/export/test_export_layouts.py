"""Export from real training checkpoints of every layout: the trainer runs 2 SGD steps (fp32, tiny model)
on TP=2, PP=2 and MoE EP=2 (dp=2) in one torchrun launch, each saving its own DCP checkpoint; one process
runs the same jobs in-process. Each checkpoint, merged and written by the export code, gives the same
Hugging Face weights as the single-process one (within 1e-5: the parity tests show the layouts train to
the same weights) and transformers' logits agree. Unlike test_export_merge.py's shards split by hand,
these are the trainer's own checkpoints, sharded the way the trainer shards them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures.trainer_data import VOCAB, byte_tokens  # noqa: F401  (the fixture)
from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from stages.export.hf import read_safetensors, write_hf
from stages.export.merge import complete_state_dict, find_checkpoint, load_full_state_dict

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("export_layouts_worker.py")
DENSE = {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 128}
MOE = {**DENSE, "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": None, "balance": "aux_loss"}}
LAYOUTS = {  # name -> (model, parallel settings on 2 ranks)
    "tp2": (DENSE, {"tp": 2}),
    "pp2": (DENSE, {"pp": 2}),
    "ep2": (MOE, {"dp": 2, "ep": 2}),
}


def spec(tmp: Path, tokens: Path, name: str, model: dict, world: int = 1, **parallel) -> JobSpec:
    cfg = LifecycleConfig.model_validate({
        "name": "export-layouts", "seed": 0, "model": model, "tokenizer": {"vocab_size": VOCAB},
        "parallel": {"nproc_per_node": world, **parallel},
        "infra": {"health_check": False},
        "pretrain": {"steps": 2, "seq_len": 32, "micro_batch_size": 2, "global_batch_size": 8, "lr": 0.3,
                     "warmup_steps": 1, "precision": "fp32", "peak_flops": 1e11, "optimizer": "sgd",
                     "grad_clip": 1.0, "checkpoint": {"every": 2, "async_save": False}},
    }).model_dump(mode="json")
    return JobSpec(job_id=name, stage="pretrain", config=cfg, inputs={"tokens": str(tokens)},
                   output=str(tmp / name / "out"), workdir=str(tmp / name / "work"))


def export(job: JobSpec, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The export stage's path: find the committed checkpoint, merge, write hf/. Returns (the merged
    state dict, the Hugging Face tensors written)."""
    cfg = LifecycleConfig.model_validate(job.config).model
    ckpt = find_checkpoint(job.output)
    assert (ckpt / ".metadata").is_file(), f"{ckpt} is not the trainer's DCP checkpoint"
    sd = complete_state_dict(load_full_state_dict(ckpt), cfg)
    write_hf(sd, cfg, out, dtype="float32")
    return sd, read_safetensors(out)


@pytest.fixture(scope="module")
def layouts(byte_tokens, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("export_layouts")
    jobs = {n: spec(tmp, byte_tokens, n, model, world=2, **par) for n, (model, par) in LAYOUTS.items()}
    files = [str(j.write(tmp / f"{n}.yaml")) for n, j in jobs.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), *files], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]

    from trainer.trainer import Trainer

    refs = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for kind, model in (("dense", DENSE), ("moe", MOE)):
            ref = spec(tmp, byte_tokens, f"one-{kind}", model)
            assert Trainer(ref).run().status == "completed"
            refs[kind] = ref
    finally:
        torch.set_num_threads(threads)
    return tmp, jobs, refs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_checkpoint_exports_like_one_process(layouts, name):
    from transformers import AutoModelForCausalLM

    from trainer.meta_init import build_model

    tmp, jobs, refs = layouts
    ref_job = refs["moe" if jobs[name].config["model"].get("moe") else "dense"]
    merged, got = export(jobs[name], tmp / name / "hf")
    _, want = export(ref_job, tmp / f"{ref_job.job_id}-{name}" / "hf")
    assert got.keys() == want.keys()
    for k, w in want.items():
        torch.testing.assert_close(got[k], w, rtol=0, atol=1e-5, msg=k)
    # the two steps really trained what is compared (not two copies of the initial weights)
    cfg = LifecycleConfig.model_validate(ref_job.config)
    init = build_model(cfg, torch.device("cpu"), cfg.seed).state_dict()
    moved = [k for k, v in merged.items() if k in init and not torch.allclose(v, init[k], atol=1e-6)]
    assert len(moved) > len(merged) // 2, moved

    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for d in (tmp / name / "hf", tmp / f"{ref_job.job_id}-{name}" / "hf"):
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert (logits[0] - logits[1]).abs().max() < 1e-4
