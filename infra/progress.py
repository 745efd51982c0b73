"""Progress bars for long loops (training steps, data passes, packing, the ablation sweep): one
convention for all of them. A bar goes to stderr, so stdout (and Prefect's `log_prints`) stays for
results; it redraws at most every `MININTERVAL_S` seconds, so where stderr is a log file (CI, a Prefect
worker, a trainer job's log) a loop leaves a start line, one update per interval and its final
count, not thousands. `TQDM_DISABLE=1` in the environment (tqdm's own switch, read when tqdm is
first imported) turns every bar off."""

from __future__ import annotations

import sys

MININTERVAL_S = 2.0


def progress_bar(total: int | float | None, desc: str, unit: str, enabled: bool = True, **kwargs):
    """A tqdm bar on the current sys.stderr (looked up now, so a captured stream gets it); with
    `enabled=False` a bar that draws nothing. Extra keyword arguments go to tqdm (`unit_scale=True`
    for token counts, `initial=...`)."""
    from tqdm.auto import tqdm

    if not enabled:
        kwargs["disable"] = True
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=MININTERVAL_S, **kwargs)

