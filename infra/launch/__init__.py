"""Launchers: hand a job file to torchrun on this machine, to Slurm or to Kubernetes; wait, stream
logs, cancel, and read the job's `result.json`."""
