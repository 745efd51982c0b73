"""Run under torchrun by test_faults_layouts.py: in one process group, train job A to the end
(checkpoints at every step of `every`), copy A's first checkpoint into the outputs of the other jobs,
then run them: each resumes from that checkpoint (B on A's mesh: exact resume; C on another mesh:
resharding). The test compares the final checkpoints afterwards, outside the process group.
A = "-": no job A; the test has put the checkpoint in the other jobs' outputs already (it was saved
on a mesh of another world size)."""

import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.launch.job import JobSpec
from trainer.checkpoint import step_dir
from trainer.process_group import init_distributed
from trainer.trainer import Trainer


def main(first_step: int, whole: str, *others: str) -> None:
    a = JobSpec.read(whole if whole != "-" else others[0])
    init_distributed(LifecycleConfig.model_validate(a.config))
    if whole != "-":
        assert Trainer(a).run().status == "completed"
    for path in others:
        spec = JobSpec.read(path)
        if whole != "-" and dist.get_rank() == 0:
            shutil.copytree(Path(a.output) / "checkpoints" / step_dir(first_step),
                            Path(spec.output) / "checkpoints" / step_dir(first_step))
        dist.barrier()
        assert Trainer(spec).run().status == "completed"
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:])
