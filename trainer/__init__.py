"""The built-in parallel trainer, launched as `torchrun -m trainer JOB.yaml`: the model (which knows
nothing of parallelism), the parallel plans applied from outside, the optimizer, the packed-shard
loader, checkpoints, health and metrics. Never imports Prefect or `stages/`."""
