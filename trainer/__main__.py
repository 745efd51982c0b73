"""`torchrun --nproc-per-node N -m trainer JOB.yaml` (or `python -m trainer JOB.yaml` for one process)."""

import sys

from .loop import run_job


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m trainer JOB.yaml", file=sys.stderr)
        return 2
    return run_job(argv[0])


if __name__ == "__main__":
    sys.exit(main())
