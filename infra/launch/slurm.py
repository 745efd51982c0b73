"""The Slurm launcher: an sbatch script rendered from `infra/templates/sbatch.sh.j2`, followed with
`scontrol show job`, cancelled with `scancel`.

The script asks for `nnodes` nodes with one task each; `srun` starts one torchrun agent per node and
the agents meet at a c10d rendezvous on the allocation's first node (`scontrol show hostnames`).
Before torchrun, one health probe per node (infra/node_health.py) writes each node's report to the
job's output store; a bad node is named in result.json and the job exits NODE_HEALTH_EXIT (75)
without training. Nodes that failed health checks are kept out with `--exclude`, from the config's
list and from a file the stage appends to. The job's workdir and job file must be on a filesystem every node
sees (the usual shared home or scratch of a cluster); outputs go to the job's output URI.

State comes from `scontrol show job` (not `sbatch --wait`, which polls at 2 s, 8 s, 32 s). A job
that slurmctld has already forgotten (older than its MinJobAge) is looked up with `sacct`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from infra.config.launch import SlurmConfig
from infra.launch.base import follow_file, read_result
from infra.launch.exclude import excluded_nodes, read_exclude_file, record_bad_nodes  # noqa: F401  (re-exported)
from infra.launch.job import JobResult, JobSpec
from infra.node_health import NODE_HEALTH_EXIT
from infra.templates import render_template

PROJECT_ROOT = Path(__file__).resolve().parents[2]
EXCLUDE_FILE = Path("slurm") / "exclude-nodes.txt"  # under the infra workdir

# Slurm job states (squeue(1) "JOB STATE CODES") in the launcher protocol's words.
_STATES = {
    "PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending", "REQUEUE_HOLD": "pending",
    "REQUEUE_FED": "pending", "RESV_DEL_HOLD": "pending", "SPECIAL_EXIT": "pending",
    "RUNNING": "running", "COMPLETING": "running", "STAGE_OUT": "running", "SIGNALING": "running",
    "SUSPENDED": "running", "STOPPED": "running", "RESIZING": "running", "UPDATE_DB": "running",
    "COMPLETED": "succeeded",
    "CANCELLED": "cancelled", "REVOKED": "cancelled",
    "FAILED": "failed", "TIMEOUT": "failed", "NODE_FAIL": "failed", "PREEMPTED": "failed",
    "BOOT_FAIL": "failed", "DEADLINE": "failed", "OUT_OF_MEMORY": "failed",
}  # fmt: skip
_FINAL = {"succeeded", "failed", "cancelled"}


class SlurmError(RuntimeError):
    """A Slurm command failed; the message holds the command and what it printed."""


def _run(cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise SlurmError(
            f"'{cmd[0]}' is not on PATH: this machine has no Slurm client "
            "(for a local single-node Slurm run `eval \"$(bash infra/slurm/start.sh)\"`)"
        )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _failure(what: str, out: subprocess.CompletedProcess) -> SlurmError:
    text = (out.stderr or out.stdout).strip()
    if "Could not establish a configuration source" in text:
        text += (
            "\n(no slurm.conf found: set SLURM_CONF; for the local single-node Slurm run "
            '`eval "$(bash infra/slurm/start.sh)"`)'
        )
    return SlurmError(f"{what} failed (exit {out.returncode}): {text}")


def parse_job_record(text: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {field: value}. The fields we read (JobState, ExitCode,
    NodeList, Reason) hold no spaces; free-text fields later on the line may, so the first
    occurrence of a key wins."""
    fields: dict[str, str] = {}
    for token in text.split():
        key, eq, value = token.partition("=")
        if eq and key.isidentifier():
            fields.setdefault(key, value)
    return fields


def exit_code_of(field: str) -> int:
    """Slurm's `ExitCode=code:signal` -> a shell-style exit code (128 + signal when killed)."""
    code, _, sig = field.partition(":")
    code_i, sig_i = int(code or 0), int(sig or 0)
    return code_i if code_i or not sig_i else 128 + sig_i


class SlurmJob:
    """A submitted sbatch job, followed through scontrol (and sacct once slurmctld forgot it)."""

    def __init__(self, job_id: str, slurm_id: str, log_path: Path, script: Path, poll_interval_s: float = 1.0):
        self.job_id = job_id  # the eightfold job id (JobSpec.job_id)
        self.slurm_id = slurm_id
        self.log_path = log_path
        self.script = script
        self.poll_interval_s = poll_interval_s
        self.slurm_state = "PENDING"
        self.exit_code: int | None = None
        self.nodes: str | None = None
        self.reason: str | None = None

    def __repr__(self) -> str:
        return f"SlurmJob({self.job_id!r}, slurm_id={self.slurm_id}, state={self.slurm_state})"

    def refresh(self) -> str:
        """Ask Slurm once; returns the raw Slurm state (RUNNING, COMPLETED, CANCELLED, ...)."""
        if self.exit_code is not None and _STATES.get(self.slurm_state) in _FINAL:
            return self.slurm_state  # final states do not change
        out = _run(["scontrol", "show", "job", "-o", self.slurm_id])
        if out.returncode == 0 and out.stdout.strip():
            rec = parse_job_record(out.stdout)
            state, exit_field = rec.get("JobState", "UNKNOWN"), rec.get("ExitCode", "0:0")
            self.nodes, self.reason = rec.get("NodeList"), rec.get("Reason")
        elif "Invalid job id" in (out.stderr + out.stdout):
            state, exit_field = self._from_sacct()
        else:
            raise _failure(f"scontrol show job {self.slurm_id}", out)
        self.slurm_state = state.split()[0].rstrip("+")
        if _STATES.get(self.slurm_state) in _FINAL:
            self.exit_code = exit_code_of(exit_field)
        return self.slurm_state

    def _from_sacct(self) -> tuple[str, str]:
        out = _run(["sacct", "-n", "-P", "-X", "-j", self.slurm_id, "-o", "State,ExitCode"])
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        if not line:
            raise SlurmError(
                f"slurm job {self.slurm_id} is no longer known to slurmctld (older than MinJobAge) and sacct "
                f"has no record of it ({(out.stderr or 'no accounting').strip()})"
            )
        state, exit_field = line.split("|")[:2]
        return state, exit_field

    def poll(self) -> str:
        state = self.refresh()
        if state not in _STATES:
            raise SlurmError(f"slurm job {self.slurm_id} is in state {state!r}, which this launcher does not know")
        return _STATES[state]

    def wait(self, timeout: float | None = None) -> int:
        """Block until the job ends; returns its exit code (0 = succeeded), raises TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() not in _FINAL:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"slurm job {self.slurm_id} ({self.job_id}) still {self.slurm_state} after {timeout} s "
                    f"(reason {self.reason}; log {self.log_path})"
                )
            time.sleep(self.poll_interval_s)
        code = self.exit_code or 0
        if self.poll() != "succeeded" and code == 0:
            code = 1  # TIMEOUT, NODE_FAIL and friends can end with ExitCode 0:0
        return code

    def cancel(self, timeout: float = 60.0) -> None:
        """scancel, then wait until Slurm reports the job ended (its processes are gone by then)."""
        if self.poll() in _FINAL:
            return
        out = _run(["scancel", self.slurm_id])
        if out.returncode != 0:
            raise _failure(f"scancel {self.slurm_id}", out)
        deadline = time.monotonic() + timeout
        # The job stays COMPLETING until slurmd has ended every process of it (SIGTERM, then SIGKILL
        # after KillWait). Slurm 22.05's scontrol shows that; versions that show CANCELLED with a
        # completing flag still show COMPLETING in squeue, so ask both before saying it is gone.
        while self.poll() not in _FINAL or self._completing():
            if time.monotonic() > deadline:
                raise SlurmError(f"slurm job {self.slurm_id} still {self.slurm_state} {timeout} s after scancel")
            time.sleep(min(self.poll_interval_s, 0.5))

    def _completing(self) -> bool:
        out = _run(["squeue", "-h", "-j", self.slurm_id, "-o", "%T"])
        return out.returncode == 0 and "COMPLETING" in out.stdout

    def logs(self, follow: bool = False) -> Iterator[str]:
        if not follow:
            if self.log_path.exists():
                yield from self.log_path.read_text(errors="replace").splitlines(keepends=True)
            return
        yield from follow_file(self.log_path, lambda: self.poll() in _FINAL, poll_s=self.poll_interval_s)


class SlurmLauncher:
    """Submit job files to Slurm with sbatch. Nodes and ranks per node come from the job's
    `parallel:` section unless given here; `module` replaces the trainer (tests use a tiny one)."""

    name = "slurm"

    def __init__(
        self,
        config: SlurmConfig | None = None,
        *,
        nnodes: int | None = None,
        nproc_per_node: int | None = None,
        module: str = "trainer",
        env: dict[str, str] | None = None,
        exclude_file: str | Path | None = None,
        template: str | Path = "sbatch.sh.j2",
    ):
        self.config = config or SlurmConfig()
        for name, value in (("nnodes", nnodes), ("nproc_per_node", nproc_per_node)):
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        self.nnodes, self.nproc_per_node, self.module = nnodes, nproc_per_node, module
        self.env = dict(env or {})
        self.exclude_file = Path(exclude_file) if exclude_file else (
            Path(self.config.exclude_file) if self.config.exclude_file else None
        )
        self.template = template

    @classmethod
    def from_config(cls, cfg, workdir: str | Path, **kwargs) -> "SlurmLauncher":
        """From a LifecycleConfig: `infra.slurm`, with the exclude file defaulting to the workdir's."""
        slurm = cfg.infra.slurm
        exclude_file = Path(slurm.exclude_file) if slurm.exclude_file else Path(workdir) / EXCLUDE_FILE
        return cls(slurm, exclude_file=exclude_file, **kwargs)

    def excluded_nodes(self) -> list[str]:
        return excluded_nodes(self.config.exclude, read_exclude_file(self.exclude_file))

    def _shape(self, spec: JobSpec) -> tuple[int, int]:
        parallel = spec.config.get("parallel") or {}
        nnodes = self.nnodes or int(parallel.get("nnodes", 1))
        nproc = self.nproc_per_node or int(parallel.get("nproc_per_node", 1))
        return nnodes, nproc

    def render(self, spec: JobSpec, job_file: Path) -> str:
        """The sbatch script for this job (what `submit` writes next to the job's logs)."""
        c = self.config
        nnodes, nproc = self._shape(spec)
        workdir = Path(spec.workdir).expanduser().resolve()
        env = {"PYTHONUNBUFFERED": "1", "EIGHTFOLD_JOB_ID": spec.job_id, **self.env, **spec.env}
        bad = [k for k in env if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(f"environment variable names {bad} are not valid shell names")
        return render_template(
            self.template,
            job_name=f"eightfold-{spec.job_id}"[:128],
            nnodes=nnodes,
            nproc_per_node=nproc,
            cpus_per_task=c.cpus_per_task,
            gpus_per_node=c.gpus_per_node,
            mem=c.mem,
            time_limit=c.time_limit,
            partition=c.partition,
            account=c.account,
            qos=c.qos,
            exclusive=c.exclusive,
            exclude=self.excluded_nodes(),
            log_pattern=str(self.log_path(spec)),
            extra_args=c.extra_args,
            setup=c.setup,
            workdir=str(workdir),
            env=env,
            repo_root=str(PROJECT_ROOT),
            rdzv_port=c.rdzv_port,
            python=c.python or sys.executable,
            max_restarts=c.max_restarts,
            module=self.module,
            job_file=str(Path(job_file).resolve()),
            node_health=c.node_health and (spec.config.get("infra") or {}).get("health_check", True),
            node_health_exit=NODE_HEALTH_EXIT,
            node_health_timeout_s=c.node_health_timeout_s,
        )

    @staticmethod
    def log_path(spec: JobSpec) -> Path:
        # Same place as the local launcher's log; --open-mode=append keeps every retry's output.
        return Path(spec.workdir).expanduser().resolve() / "logs" / f"{spec.job_id}.log"

    def submit(self, spec: JobSpec, job_file: Path) -> SlurmJob:
        job_file = Path(job_file).resolve()
        if not job_file.is_file():
            raise FileNotFoundError(f"job file {job_file} does not exist (write it with JobSpec.write)")
        log_path = self.log_path(spec)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        script = log_path.parent / f"{spec.job_id}.sbatch"
        script.write_text(self.render(spec, job_file))
        out = _run(["sbatch", "--parsable", str(script)])
        if out.returncode != 0:
            raise _failure(f"sbatch {script}", out)
        # --parsable prints "jobid" or "jobid;cluster".
        slurm_id = out.stdout.strip().splitlines()[-1].split(";")[0]
        if not slurm_id.isdigit():
            raise SlurmError(f"sbatch {script} printed {out.stdout.strip()!r}, expected a job id")
        return SlurmJob(spec.job_id, slurm_id, log_path, script, self.config.poll_interval_s)

    def result(self, spec: JobSpec) -> JobResult | None:
        return read_result(spec)
