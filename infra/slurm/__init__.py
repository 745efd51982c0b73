"""A real single-node Slurm for tests and laptops: `start.sh` installs Debian's slurm-wlm and munge
if missing, writes a slurm.conf from `slurmd -C`, starts munged, slurmctld and slurmd as plain
daemons (no systemd, no cgroups), waits for the node to be idle and prints the environment to
export; `stop.sh` cancels its jobs and stops the daemons by their pid files. The Slurm launcher
itself lives in `infra/launch/slurm.py`."""
