"""Hand the evaluation texts to the data stage's decontamination (stages/data/decontaminate.py):
`register()` adds a provider returning the verifiable task family's held-out problems as they are
posed and answered (prompt + answer), so no training document containing one survives.

What is not registered, and why: the held-out perplexity and code-completion tasks are cut from the
data stage's own validation split, which never reaches training (the split is by document hash), so
they cannot be contaminated by it - and registering them would remove them from the corpus they come
from. Note that the data stage matches word 13-grams (GPT-3's rule): a short arithmetic problem has
fewer words than that and is counted by the data card as too short to match; the hash split of the
task family (task_family.split_of) is what keeps post-train's training problems off the held-out set.
"""

from __future__ import annotations

from infra.config import LifecycleConfig
from infra.config.evaluate import EvaluateConfig

from .task_family import KINDS

PROVIDER = "evaluate-task-family"


def eval_texts(cfg: LifecycleConfig | None) -> list[str]:
    """The held-out task family texts the evaluate stage will score, for this config."""
    from .suite import family_rows

    ecfg = getattr(cfg, "evaluate", None) or EvaluateConfig()
    rows = family_rows(ecfg)
    return [r["prompt"] + r["completion"] for kind in KINDS for r in rows[kind]]


def register() -> None:
    """Register the provider with the data stage (idempotent)."""
    from stages.data.decontaminate import register_eval_texts

    register_eval_texts(PROVIDER, eval_texts)
