"""Run under torchrun by test_export_layouts.py: the trainer jobs named on the command line, one after
another in one process group (one launch for every layout of one world size), each to its end with
checkpointing on, so each leaves its own DCP checkpoint for the export code to read."""

import sys

import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from trainer.process_group import init_distributed
from trainer.trainer import Trainer


def main(*job_files: str) -> None:
    specs = [JobSpec.read(f) for f in job_files]
    init_distributed(LifecycleConfig.model_validate(specs[0].config))
    for spec in specs:
        result = Trainer(spec).run()
        assert result.status == "completed", (spec.job_id, result)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
