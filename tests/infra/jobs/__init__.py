"""Tiny torchrun job modules the launcher and health tests run (`python -m torch.distributed.run -m
tests.infra.jobs.<name> JOB.yaml`): they speak the job contract (read the job file, write
result.json) without the trainer."""
