"""A real Slurm of EIGHTFOLD_SLURM_NODES nodes (default 2) on this one machine, for tests and laptops:
`start.sh` installs Debian's slurm-wlm and munge if missing, writes a slurm.conf (one node line per
node, an even share of the cores each), starts munged, slurmctld and one slurmd per node as plain
daemons (multiple-slurmd mode; no systemd, no cgroups), waits for every node to be idle and prints the
environment to export; `stop.sh` cancels its jobs and stops the daemons by their pid files. README.md
says what was tried. The Slurm launcher itself lives in `infra/launch/slurm.py`."""
