"""Run under torchrun by test_ddp.py: train a job's steps and, on rank 0, save the per-step losses and
the final weights (checkpoints come in a later issue, so the test saves them itself)."""

import sys

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from trainer.parallel.ddp import unwrap
from trainer.process_group import init_distributed
from trainer.step import train_step
from trainer.trainer import Trainer


def main(job_file: str, out_file: str) -> None:
    spec = JobSpec.read(job_file)
    init_distributed(LifecycleConfig.model_validate(spec.config))
    tr = Trainer(spec)
    losses, norms = [], []
    for step in range(tr.train_cfg.steps):
        res = train_step(tr.model, tr.optimizer, tr.loader.next_step(), tr.objective, tr.train_cfg, step,
                         tr.device, tr.dp_group)
        losses.append(res.loss)
        norms.append(res.grad_norm)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        state = {k: v.detach().clone() for k, v in unwrap(tr.model).state_dict().items()}
        torch.save({"losses": losses, "grad_norms": norms, "state": state}, out_file)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
