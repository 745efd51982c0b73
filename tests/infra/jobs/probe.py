"""A test job: `EIGHTFOLD_TEST_JOB_MODE` picks what the ranks do.

- allreduce: gloo all-reduce of (rank + 1) everywhere, checks the sum n(n+1)/2, rank 0 writes
  result.json and logs the sum to the stage's MLflow run (like the trainer's rank 0 does);
- sleep: every rank writes its pid and sleeps forever (rank 1 ignores SIGTERM, so cancelling must
  escalate to SIGKILL);
- fail: rank 1 exits with code 3 while rank 0 would sleep; torchrun must end rank 0 too.
"""

import os
import signal
import sys
import time
from pathlib import Path

from infra.launch import JobResult, JobSpec, write_result


def main(job_file: str) -> None:
    spec = JobSpec.read(job_file)
    mode = os.environ["EIGHTFOLD_TEST_JOB_MODE"]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"rank {rank}/{world} mode {mode} device {os.environ.get('EIGHTFOLD_DEVICE')}", flush=True)

    if mode == "sleep":
        pids = Path(spec.workdir) / "pids"
        pids.mkdir(parents=True, exist_ok=True)
        if rank == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (pids / f"rank{rank}.pid").write_text(str(os.getpid()))
        while True:
            time.sleep(0.2)

    if mode == "fail":
        if rank == 1:
            print("rank 1 failing on purpose", flush=True)
            sys.exit(3)
        time.sleep(120)
        return

    import torch  # only here: the sleep and fail ranks start faster without it
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    ok = bool(torch.all(x == expected))
    if rank == 0:
        metrics = {"allreduce_sum": float(x[0]), "world_size": float(world)}
        if spec.tracking.run_id:
            from infra.tracking import RunLogger

            with RunLogger(spec.tracking.uri, spec.tracking.run_id) as logger:
                logger.log_metrics(metrics, step=1)
        status = "completed" if ok else "failed"
        write_result(spec, JobResult(status=status, steps=1, metrics=metrics, message=f"expected {expected}"))
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
