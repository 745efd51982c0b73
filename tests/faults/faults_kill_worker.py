"""Run under torchrun --max-restarts=N by test_faults_kill_matrix.py: for each layout in order, an
uninterrupted job, then the same job with one rank SIGKILLed after a drawn step. torchrun restarts the
whole group after each kill, so the script starts again from the top: finished jobs are skipped (a
`done` marker beside their output), and the killed job resumes from its latest committed checkpoint.
Killed job j fires on restart attempt j (the j kills before it each restarted the group once)."""

import sys
from pathlib import Path

import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from trainer.process_group import init_distributed
from trainer.trainer import Trainer


def run_once(spec: JobSpec) -> None:
    done = Path(spec.output) / "done"
    if done.exists():
        return
    assert Trainer(spec).run().status == "completed"
    dist.barrier()
    if dist.get_rank() == 0:
        done.touch()
    dist.barrier()


def main(*job_files: str) -> None:
    specs = [JobSpec.read(f) for f in job_files]
    init_distributed(LifecycleConfig.model_validate(specs[0].config))
    for spec in specs:
        run_once(spec)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
