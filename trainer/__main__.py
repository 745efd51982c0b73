"""`torchrun --nproc-per-node N -m trainer JOB.yaml` (or `python -m trainer JOB.yaml` for one process):
join the process group, run the job the spec's section names, then rank 0 writes result.json."""

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import threading
import traceback

import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.launch.base import endpoint_for, write_result
from infra.launch.job import JobResult, JobSpec

from . import audit
from .job_io import OutputFolder
from .process_group import init_distributed
from .trainer import Trainer


def finish(spec: JobSpec, output: OutputFolder, result: JobResult) -> None:
    """Upload the output folder (if remote), then write result.json last: its presence means done."""
    output.publish()
    write_result(spec, result)


_KEPT: list = []
"""The finished job (model, optimizer, DDP, device meshes: what holds the process groups), never destroyed
in this process: the rank leaves through exit_within, past the teardown that would destroy them."""


def run_job(job_file: str) -> int:
    """The `python -m trainer JOB.yaml` entry point: train, then rank 0 writes result.json. Returns the
    process exit code (0 completed, 1 failed, 2 diverged)."""
    audit.install()  # off unless a drill asks (trainer/audit.py)
    # A cancelled rank (the stage ends a job stuck after its result, a user cancels a hung one) prints every
    # thread's stack into the job's log on its way out: where it was is what the person looking needs.
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
    spec = JobSpec.read(job_file).on_this_node()  # inputs cache, staging, heartbeats: this node's own disk
    cfg = LifecycleConfig.model_validate(spec.config)
    init_distributed(cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    job = None
    try:
        if spec.section.startswith("posttrain."):  # SFT / DPO / GRPO objectives: trainer/posttrain_job.py
            from .posttrain_job import PosttrainJob

            job = PosttrainJob(spec)
        else:
            job = Trainer(spec)
        result = job.run()
    except Exception as exc:  # result.json says why, then the launcher sees a non-zero exit
        traceback.print_exc()
        if rank == 0:
            output = job.output if job is not None else OutputFolder(spec.output, spec.workdir, endpoint_for(spec))
            finish(spec, output, JobResult(status="failed", message=f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        _KEPT.append(job)  # not torn down when this frame is (exit_within says why)
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        finish(spec, job.output, result)
        print(f"trainer: {result.status} after {result.steps} steps: "
              + ", ".join(f"{k}={v:.4g}" for k, v in result.metrics.items()), file=sys.stderr)
    return {"completed": 0, "failed": 1, "diverged": 2}[result.status]


EXIT_GRACE_S = 60.0


def exit_within(code: int, grace_s: float = EXIT_GRACE_S) -> None:
    """Leave with `code` once the job is done: run the atexit handlers (logging's flush, MLflow's, the
    compile workers' shutdown), flush the streams and `os._exit`, skipping the interpreter's teardown of
    objects and its wait for non-daemon threads a library left running.

    That teardown is where ranks hung. Seen in CI after a completed two-node SFT job: the rank's stacks
    showed the main thread in `main` just after run_job returned (its locals, the job and the process
    groups it holds, being destroyed), no deeper frame, and one frameless thread beside it, until the stage
    cancelled it 90 s later. Most likely a gloo group's destructor joining a worker thread that waits for
    the GIL the destructor holds, to drop a tensor's Python object (the hazard pytorch/pytorch#179291
    describes for gloo's workers at teardown). So the job is kept (`_KEPT`) and never destroyed.

    An atexit handler that takes longer than `grace_s` is cut short: a watchdog prints every thread's stack
    and leaves with `code`. One stuck in C holding the GIL, where no watchdog thread can run, is ended by
    the stage, which cancels a job whose completed result.json is in (stages.pretrain.TEARDOWN_GRACE_S):
    SIGTERM then prints this rank's stacks, whole (not chained to the default action, which would end the
    process mid-dump when a second SIGTERM comes, from the agent and the launcher both), and the SIGKILL
    that follows every cancel ends it."""
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=False)

    def _leave() -> None:
        print(f"trainer: shutdown took over {grace_s:.0f}s; threads still running:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(code)

    watchdog = threading.Timer(grace_s, _leave)
    watchdog.daemon = True
    watchdog.start()
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream must not keep the rank here
                stream.flush()
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainer JOB.yaml", file=sys.stderr)
        return 2
    return run_job(argv[0])


if __name__ == "__main__":
    exit_within(main())
