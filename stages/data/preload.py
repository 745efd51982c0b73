"""What the local executor's forkserver imports once before it forks the pool workers (executors.PRELOAD), so
each worker starts as a cheap fork: the pipeline's modules (importing `steps` also installs speedups, which
makes datatrove's dependency checks cheap; the forked workers inherit its caches).
"""

import datatrove.executor.local  # noqa: F401
import datatrove.pipeline.dedup.exact_dedup  # noqa: F401
import datatrove.pipeline.dedup.minhash  # noqa: F401
import datatrove.pipeline.filters  # noqa: F401
import datatrove.pipeline.writers  # noqa: F401

from . import dedup, steps  # noqa: F401
from .speedups import distribution_available

for _name in ("pyarrow", "xxhash"):
    distribution_available(_name)
