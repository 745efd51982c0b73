"""The local launcher: torchrun on this machine as a subprocess in its own process group.

`python -m torch.distributed.run --standalone --nproc-per-node N -m <module> JOB.yaml` runs in a new
session, so the torchrun agent and every rank it starts share one process group that `cancel()`
can signal as a whole: SIGTERM first (torchrun forwards it and ranks may save), SIGKILL after a
grace period, so no agent, rank or data-loader worker survives. Output of all ranks goes to
`<spec.workdir>/logs/<job_id>.log` (written by the job itself, so the log survives this process)
and is optionally echoed here. A job of one process that may not restart runs without the agent
(`python -m <module> JOB.yaml`, given the environment torchrun gives its one rank).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator

import psutil

from infra.launch.base import JobState, follow_file, read_result
from infra.launch.job import NODE_DIR_ENV, JobResult, JobSpec

PROJECT_ROOT = Path(__file__).resolve().parents[2]

# A job runs in its own session, so Ctrl-C on the launching process does not reach it. Jobs still
# running when this interpreter exits are cancelled, so an interrupted `eightfold run` leaves none.
_LIVE: "weakref.WeakSet[LocalJob]" = weakref.WeakSet()


@atexit.register
def _cancel_live_jobs() -> None:
    for job in list(_LIVE):
        if job.poll() == "running":
            job.cancel(grace_s=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Processes still running. A zombie has exited and holds no memory; only its parent's wait()
    removes it, and orphans are reaped by init, so it does not count as a survivor."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


class LocalJob:
    """A running torchrun job: one agent per simulated node, each with its ranks in its own process
    group (a process cannot join a group of another session, so each agent leads one)."""

    peer_grace_s = 10.0  # after a node fails, how long its peers may take to end on SIGTERM

    def __init__(self, job_id: str, procs: list[subprocess.Popen], log_path: Path, echo: bool):
        self.job_id = job_id
        self.log_path = log_path
        self.pgids = [p.pid for p in procs]  # each agent leads its own session and process group
        self._procs = procs
        self._cancelled = False
        self._failed_code: int | None = None  # the first failed node's exit code, once its peers are ended
        self._done = threading.Event()
        self._echo = None
        _LIVE.add(self)
        if echo:
            self._echo = threading.Thread(target=self._echo_log, name=f"echo-{job_id}", daemon=True)
            self._echo.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _exit_code(self) -> int | None:
        if self._failed_code is not None:
            return self._failed_code if all(p.poll() is not None for p in self._procs) else None
        codes = [p.poll() for p in self._procs]
        if any(c is None for c in codes):
            return None
        return next((c for c in codes if c != 0), 0)

    def _end_if_a_node_failed(self) -> bool:
        """A node whose agent failed ends the job, as Slurm's --kill-on-bad-exit does: its peers'
        agents cannot know (the static rendezvous is done) and their ranks could wait for it in a
        store or a collective; they are terminated and the job fails with the first failed node's code."""
        if self._failed_code is None:
            failed = [c for c in (p.poll() for p in self._procs) if c not in (None, 0)]
            if not failed or all(p.poll() is not None for p in self._procs):
                return False
            self._failed_code = failed[0]
            self._terminate(grace_s=self.peer_grace_s)
        return True

    def poll(self) -> JobState:
        code = self._exit_code()
        if code is None and self._end_if_a_node_failed():
            code = self._exit_code()
        if code is None:
            return "running"
        self._finish()
        if self._cancelled:
            return "cancelled"
        return "succeeded" if code == 0 else "failed"

    def wait(self, timeout: float | None = None) -> int:
        """Until every node's agent has exited; the job's exit code. A failed node ends the job."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._exit_code() is None and not self._end_if_a_node_failed():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} still running after {timeout} s (log: {self.log_path})")
            time.sleep(0.2)
        self._finish()
        return self._exit_code()

    def kill_node(self, node: int) -> None:
        """SIGKILL every process of one simulated node at once (its agent's group): a node lost, with no
        chance to save or say goodbye. The other nodes find out through their collectives."""
        try:  # the ranks first: torchrun starts them in sessions of their own, out of the agent's group
            family = [psutil.Process(self.pids[node]), *psutil.Process(self.pids[node]).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for p in reversed(family):
            _signal(p, signal.SIGKILL)
        try:
            os.killpg(self.pgids[node], signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._procs[node].wait()

    def cancel(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`; returns when nothing of the job runs."""
        self._cancelled = True
        self._terminate(grace_s)

    def _terminate(self, grace_s: float) -> None:
        """SIGTERM to every node's group, SIGKILL after `grace_s`; returns when nothing of the job runs."""
        if all(p.poll() is not None for p in self._procs):
            self._finish()
            return
        # Remember every descendant too: a rank that started its own session would escape killpg.
        family = self._family()
        self._signal_group(signal.SIGTERM)
        for p in family:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for p in self._procs:
                p.poll()  # reap the agents so they do not linger as zombies of ours
            if not _alive(family) and self._exit_code() is not None:
                break
            time.sleep(0.1)
        else:
            # Ranks first, so the agent (still alive) reaps them instead of leaving orphans to init.
            agents = set(self.pids)
            for p in _alive(family):
                if p.pid not in agents:
                    _signal(p, signal.SIGKILL)
            for p in self._procs:
                try:
                    p.wait(2)
                except subprocess.TimeoutExpired:
                    pass
            self._signal_group(signal.SIGKILL)
            for p in _alive(family):
                _signal(p, signal.SIGKILL)
        for p in self._procs:
            p.wait()
        psutil.wait_procs(_alive(family), timeout=5)
        self._finish()

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, exc_type, *_) -> None:
        """Leaving the block early (an exception, Ctrl-C, a cancelled task) cancels the job."""
        if self.poll() == "running":
            self.cancel()

    def logs(self, follow: bool = False) -> Iterator[str]:
        """The job's output lines so far, or until it ends with follow=True."""
        if not follow:
            if self.log_path.exists():
                yield from self.log_path.read_text(errors="replace").splitlines(keepends=True)
            return
        yield from follow_file(self.log_path, lambda: self._exit_code() is not None)

    # --- internals -------------------------------------------------------------------------------
    def _family(self) -> list[psutil.Process]:
        family = []
        for p in self._procs:
            try:
                root = psutil.Process(p.pid)
                family += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return family

    def _signal_group(self, sig: int) -> None:
        for pgid in self.pgids:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _finish(self) -> None:
        if self._done.is_set():
            return
        # Ranks orphaned by an agent that died abruptly still sit in the job's group: end them.
        self._signal_group(signal.SIGKILL)
        self._done.set()
        if self._echo is not None and self._echo is not threading.current_thread():
            self._echo.join(timeout=5)

    def _echo_log(self) -> None:
        for line in follow_file(self.log_path, lambda: self._exit_code() is not None):
            sys.stdout.write(f"[{self.job_id}] {line}")
            sys.stdout.flush()


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


class LocalLauncher:
    """torchrun on this machine. `nnodes > 1` runs that many agents here with a static rendezvous
    on 127.0.0.1 (the multi-node code path without a cluster)."""

    name = "local"

    def __init__(
        self,
        nproc_per_node: int,
        nnodes: int = 1,
        module: str = "trainer",
        max_restarts: int = 0,
        env: dict[str, str] | None = None,
        echo: bool = False,
        node_dirs: bool | None = None,
    ):
        """`node_dirs`: give each node a folder of its own (`{workdir}/nodes/node{i}`) and nothing else;
        default: when there is more than one node."""
        if nproc_per_node < 1 or nnodes < 1:
            raise ValueError(f"nproc_per_node={nproc_per_node} and nnodes={nnodes} must be >= 1")
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts} must be >= 0")
        self.nproc_per_node, self.nnodes, self.module = nproc_per_node, nnodes, module
        self.max_restarts, self.env, self.echo = max_restarts, dict(env or {}), echo
        self.node_dirs = nnodes > 1 if node_dirs is None else node_dirs

    @property
    def agentless(self) -> bool:
        """One process that may not restart needs no elastic agent: it runs as `python -m trainer` with the
        environment torchrun would give its one rank, which saves the agent's start (a second interpreter
        importing torch: seconds per job, and the ablations start a dozen)."""
        return self.nnodes == 1 and self.nproc_per_node == 1 and self.max_restarts == 0

    def command(self, job_file: Path, node_rank: int = 0, master_port: int | None = None) -> list[str]:
        if self.agentless:
            return [sys.executable, "-m", self.module, str(job_file)]
        cmd = [sys.executable, "-m", "torch.distributed.run"]
        if self.nnodes == 1:
            cmd += ["--standalone", "--nnodes", "1"]
        else:
            cmd += [
                "--nnodes", str(self.nnodes), "--node-rank", str(node_rank),
                "--master-addr", "127.0.0.1", "--master-port", str(master_port),
            ]  # fmt: skip
        cmd += ["--nproc-per-node", str(self.nproc_per_node), "--max-restarts", str(self.max_restarts)]
        return cmd + ["-m", self.module, str(job_file)]

    def environment(self, spec: JobSpec) -> dict[str, str]:
        env = dict(os.environ)
        ranks_here = self.nproc_per_node * self.nnodes
        # torchrun would force 1 thread per rank; on CPU the ranks should share the cores instead.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks_here)))
        env["PYTHONUNBUFFERED"] = "1"  # logs arrive as they are written
        paths = [str(PROJECT_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env["EIGHTFOLD_JOB_ID"] = spec.job_id
        if self.agentless:  # what torchrun tells its one rank
            env.update(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        env.update(self.env)
        env.update(spec.env)
        return env

    def submit(self, spec: JobSpec, job_file: Path) -> LocalJob:
        job_file = Path(job_file).resolve()
        if not job_file.is_file():
            raise FileNotFoundError(f"job file {job_file} does not exist (write it with JobSpec.write)")
        log_path = Path(spec.workdir).expanduser().resolve() / "logs" / f"{spec.job_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = self.environment(spec)
        port = _free_port() if self.nnodes > 1 else None
        procs: list[subprocess.Popen] = []
        with open(log_path, "ab") as log:
            try:
                for node in range(self.nnodes):
                    node_env, node_job, cwd = env, job_file, log_path.parent.parent
                    if self.node_dirs:
                        node_env, node_job, cwd = self._node(spec, job_file, node, env)
                    procs.append(
                        subprocess.Popen(
                            self.command(node_job, node, port),
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=node_env, cwd=str(cwd), start_new_session=True,
                        )  # fmt: skip
                    )
            except BaseException:
                for p in procs:  # agents already started would wait forever for their peers
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                raise
        return LocalJob(spec.job_id, procs, log_path, self.echo)

    @staticmethod
    def node_dir(spec: JobSpec, node: int) -> Path:
        return Path(spec.workdir).expanduser().resolve() / "nodes" / f"node{node}"

    def _node(self, spec: JobSpec, job_file: Path, node: int, env: dict[str, str]) -> tuple[dict, Path, Path]:
        """A simulated node shares no path with the others, as real nodes share none: its own folder
        (EIGHTFOLD_NODE_DIR, TMPDIR, working directory) and its own copy of the job file, as a cluster
        ships it (Slurm's script, a Kubernetes ConfigMap). Only the store is common to them."""
        folder = self.node_dir(spec, node)
        (folder / "tmp").mkdir(parents=True, exist_ok=True)
        own_job = folder / job_file.name
        own_job.write_bytes(job_file.read_bytes())
        return {**env, NODE_DIR_ENV: str(folder), "TMPDIR": str(folder / "tmp")}, own_job, folder

    def result(self, spec: JobSpec) -> JobResult | None:
        return read_result(spec)
