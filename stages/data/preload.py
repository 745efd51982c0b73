"""What the local executor's forkserver imports once before it forks the pool workers (executors.PRELOAD), so
each worker starts as a cheap fork: the pipeline's modules, and datatrove's dependency checks done ahead.

datatrove checks a step's dependencies every time the step is created, unpickling included (PipelineStep.__new__),
and the first check in a process reads the metadata of every installed distribution (cached after that:
`_is_distribution_available` is an lru_cache); done here, the forked workers inherit the answers.
"""

import datatrove.executor.local  # noqa: F401
import datatrove.pipeline.dedup.exact_dedup  # noqa: F401
import datatrove.pipeline.dedup.minhash  # noqa: F401
import datatrove.pipeline.filters  # noqa: F401
import datatrove.pipeline.writers  # noqa: F401
from datatrove.utils._import_utils import _is_distribution_available

from . import dedup, steps  # noqa: F401

for _name in ("pyarrow", "xxhash"):
    _is_distribution_available(_name)
