"""datatrove executors from `data.executor`: local processes, Slurm job arrays or a Ray cluster.

`run_stages` runs a list of `PipeStage`s (a pipeline, its task count, a name) one after the other, each to
completion, and returns every task's stats. The tasks of a stage read and write only through the folders the
steps name, so all three executors run the same pipeline and produce the same files; on Slurm and Ray those
folders must be visible to every node (the infra workdir, as for the trainer's jobs).

Slurm: one sbatch job array per stage, chained with `--dependency=afterok`, submitted by datatrove's
SlurmPipelineExecutor with the trainer launcher's conventions (infra.slurm: partition, account, qos,
exclude, extra #SBATCH lines, setup lines, the nodes' Python; infra/launch/slurm.py), then followed through
the stage's completion files, with `scontrol` to notice a failed array.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from datatrove.executor.local import LocalPipelineExecutor

from infra.config import LifecycleConfig
from infra.progress import progress_bar

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class PipeStage:
    name: str
    pipeline: list
    tasks: int


# Imported once by the forkserver: each pool worker then starts as a cheap fork (stages/data/preload.py).
PRELOAD = ["stages.data.preload"]


def _preload_forkserver() -> None:
    import multiprocess

    multiprocess.get_context("forkserver").set_forkserver_preload(PRELOAD)


def start_pool_server(cfg: LifecycleConfig) -> None:
    """Start the local pool's forkserver now: its imports (PRELOAD, ~1.5 s) then overlap the stage's
    validation and planning instead of delaying the first task. No-op for one worker or another executor."""
    if cfg.data.executor == "local" and cfg.data.workers > 1:
        import multiprocess.forkserver

        _preload_forkserver()
        multiprocess.forkserver.ensure_running()


class QuietLocalExecutor(LocalPipelineExecutor):
    """datatrove's local executor with task logs in the logging folder only (console: errors), so the stage's
    own progress bars stay readable."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1):
        return super()._run_for_rank(rank, local_rank + 1, node_rank)

    def run(self, pool=None):
        """Without datatrove's process manager and executor.json (the whole pipeline, eval n-grams included, as
        JSON) that its run starts with: one worker runs the tasks in this process, one after the other; with
        `pool` (run_stages' one pool for every stage) the tasks go to it, where datatrove's run would start a
        manager and a pool for each stage (~0.4 s each). Other worker counts without a pool: datatrove's run."""
        if self.workers != 1 and pool is None:
            return super().run()
        from copy import deepcopy

        from datatrove.utils.stats import PipelineStats

        self._launched = True
        ranks = self.get_incomplete_ranks(range(self.local_rank_offset, self.local_rank_offset + self.local_tasks))
        if self.workers != 1:
            stats = list(pool.imap_unordered(partial(_pooled_task, self), ranks))
        else:
            pipeline, stats = self.pipeline, []
            try:
                for rank in ranks:
                    self.pipeline = deepcopy(pipeline)  # each task starts from fresh steps, as datatrove's loop does
                    stats.append(self._run_for_rank(rank))
            finally:
                self.pipeline = pipeline
        merged = sum(stats, start=PipelineStats())
        with self.logging_dir.open("stats.json", "wt") as f:
            merged.save_to_disk(f)
        return merged


def _pooled_task(executor: QuietLocalExecutor, rank: int):
    """One task in a pool worker (the executor arrives pickled, with its own copy of the pipeline)."""
    return executor._run_for_rank(rank)


@contextmanager
def local_pool(workers: int):
    """One forkserver pool for all of a run's stages (None for one worker): its workers fork from a server that
    has imported the pipeline's modules (PRELOAD), and a parent with threads (Prefect's) never forks itself."""
    if workers == 1:
        yield None
        return
    import multiprocess

    _preload_forkserver()
    with multiprocess.get_context("forkserver").Pool(workers) as pool:
        yield pool


@contextmanager
def quiet_datatrove():
    """datatrove re-adds a DEBUG stderr sink after every task and logs its stats table: warnings only, here."""
    import datatrove.utils.logging as dlog
    from loguru import logger

    original = dlog.setup_default_logger

    def quiet():
        logger.remove()
        logger.add(sys.stderr, level="WARNING")

    dlog.setup_default_logger = quiet
    quiet()
    try:
        yield
    finally:
        dlog.setup_default_logger = original
        original()


def _completed(logging_dir: Path) -> int:
    folder = logging_dir / "completions"
    return len(list(folder.iterdir())) if folder.is_dir() else 0


@contextmanager
def task_bar(stage: PipeStage, logging_dir: Path):
    """A progress bar of finished tasks, moved by a thread that watches the completion files."""
    done = threading.Event()
    with progress_bar(stage.tasks, f"data {stage.name}", "task") as bar:
        def watch():
            shown = 0
            while not done.wait(0.5):
                n = _completed(logging_dir)
                if n > shown:
                    bar.update(n - shown)
                    shown = n
            n = _completed(logging_dir)
            if n > shown:
                bar.update(n - shown)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()


def run_stages(cfg: LifecycleConfig, stages: list[PipeStage], logs: Path) -> dict[str, list[list[dict]]]:
    """Run the stages in order on `data.executor`; returns {stage: [per-task stats lists]}."""
    kind = cfg.data.executor
    with quiet_datatrove():
        if kind == "local":
            with local_pool(cfg.data.workers) as pool:
                for st in stages:
                    ex = QuietLocalExecutor(st.pipeline, tasks=st.tasks, workers=min(cfg.data.workers, st.tasks),
                                            logging_dir=str(logs / st.name), skip_completed=False)
                    with task_bar(st, logs / st.name):
                        ex.run(pool)
        elif kind == "ray":
            _run_ray(cfg, stages, logs)
        else:
            _run_slurm(cfg, stages, logs)
    return {st.name: read_task_stats(logs / st.name, st.tasks) for st in stages}


def read_task_stats(logging_dir: Path, tasks: int) -> list[list[dict]]:
    import json

    out = []
    for rank in range(tasks):
        f = logging_dir / "stats" / f"{rank:05d}.json"
        if f.is_file():
            out.append(json.loads(f.read_text()))
    return out


# --- Ray -----------------------------------------------------------------------------------------------------

def _run_ray(cfg: LifecycleConfig, stages: list[PipeStage], logs: Path) -> None:
    import ray
    from datatrove.executor.ray import RayPipelineExecutor

    class QuietRayExecutor(RayPipelineExecutor):
        def _run_for_rank(self, rank, local_rank=0, node_rank=-1):
            return super()._run_for_rank(rank, local_rank + 1, node_rank)

    started_here = not ray.is_initialized()
    if started_here:
        if cfg.data.ray_address:
            # Workers import the stage's modules: they get this checkout's path (an editable install may point
            # elsewhere). A local cluster's workers inherit this process's environment instead.
            env = {"env_vars": {"PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")])}}
            ray.init(address=cfg.data.ray_address, runtime_env=env, log_to_driver=False)
        else:
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")] if p)
            ray.init(num_cpus=cfg.data.workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        for st in stages:
            ex = QuietRayExecutor(st.pipeline, tasks=st.tasks, workers=min(cfg.data.workers, st.tasks),
                                  logging_dir=str(logs / st.name), skip_completed=False, mem_per_cpu_gb=0.5)
            with task_bar(st, logs / st.name):
                ex.run()
            missing = st.tasks - _completed(logs / st.name)
            if missing:
                raise RuntimeError(f"data stage {st.name!r} on Ray: {missing} of {st.tasks} tasks did not complete "
                                   f"(task logs: {logs / st.name / 'logs'})")
    finally:
        if started_here:
            ray.shutdown()


# --- Slurm ---------------------------------------------------------------------------------------------------

def _slurm_env_command(cfg: LifecycleConfig) -> str:
    sl = cfg.infra.slurm
    python = sl.python or sys.executable
    lines = list(sl.setup)
    # launch_pickled_pipeline is datatrove's entry point, next to the nodes' Python.
    lines.append(f"export PATH={shlex.quote(str(Path(python).parent))}:$PATH")
    lines.append(f"export PYTHONPATH={shlex.quote(str(PROJECT_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}")
    return "\n".join(lines)


def _slurm_executor(cfg: LifecycleConfig, st: PipeStage, logs: Path, depends):
    from datatrove.executor.slurm import SlurmPipelineExecutor

    from infra.launch.slurm import read_exclude_file

    sl, ds = cfg.infra.slurm, cfg.data.slurm
    sbatch_args: dict[str, Any] = {}
    if sl.account:
        sbatch_args["account"] = sl.account
    exclude = sorted(set(sl.exclude) | set(read_exclude_file(sl.exclude_file)))
    if exclude:
        sbatch_args["exclude"] = ",".join(exclude)
    for arg in sl.extra_args:  # "--constraint=h100" -> {"constraint": "h100"}
        key, _, value = arg.lstrip("-").partition("=")
        sbatch_args[key] = value
    partition = sl.partition or os.environ.get("EIGHTFOLD_SLURM_PARTITION") or _default_partition()
    return SlurmPipelineExecutor(
        st.pipeline, tasks=st.tasks, time=ds.time_limit, partition=partition, cpus_per_task=ds.cpus_per_task,
        mem_per_cpu_gb=ds.mem_per_cpu_gb, job_name=f"eightfold-data-{st.name}", qos=sl.qos or "",
        env_command=_slurm_env_command(cfg), sbatch_args=sbatch_args, depends=depends,
        logging_dir=str(logs / st.name), slurm_logs_folder=str(logs / st.name / "slurm"), skip_completed=False,
        requeue=False, mail_type="NONE", max_array_launch_parallel=True,
    )


def _default_partition() -> str:
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    parts = out.stdout.split()
    default = [p.rstrip("*") for p in parts if p.endswith("*")]
    if out.returncode != 0 or not parts:
        raise RuntimeError(f"data.executor=slurm: cannot list partitions (sinfo: {out.stderr.strip() or 'nothing'}); "
                           "set infra.slurm.partition")
    return (default or parts)[0].rstrip("*")


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    states = set()
    for line in out.stdout.splitlines():
        for tok in line.split():
            if tok.startswith("JobState="):
                states.add(tok.split("=", 1)[1])
    return ",".join(sorted(states))


def _run_slurm(cfg: LifecycleConfig, stages: list[PipeStage], logs: Path) -> None:
    import shutil

    if shutil.which("sbatch") is None:
        raise RuntimeError("data.executor=slurm but 'sbatch' is not on PATH (a local Slurm: "
                           "`eval \"$(bash infra/slurm/start.sh)\"`)")
    executors, prev = [], None
    for st in stages:
        prev = _slurm_executor(cfg, st, logs, prev)
        executors.append(prev)
    executors[-1].run()  # submits the chain: each array waits for the one before (afterok)
    deadline = time.monotonic() + cfg.data.slurm.timeout_s
    for st, ex in zip(stages, executors):
        with task_bar(st, logs / st.name):
            while _completed(logs / st.name) < st.tasks:
                state = _job_state(str(ex.job_id))
                if any(s in state for s in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")):
                    raise RuntimeError(f"data stage {st.name!r}: Slurm job {ex.job_id} ended {state} "
                                       f"(logs: {logs / st.name / 'slurm'}, task logs: {logs / st.name / 'logs'})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"data stage {st.name!r}: Slurm job {ex.job_id} not done after "
                                       f"{cfg.data.slurm.timeout_s:.0f}s (state {state or 'unknown'})")
                time.sleep(cfg.data.slurm.poll_s)
