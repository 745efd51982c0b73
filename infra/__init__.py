"""Where work runs and where things are kept: the validated config, the object store and the
artifact contract, MLflow tracking, launchers (local torchrun, Slurm, Kubernetes) and health checks.
Nothing here imports Prefect."""
