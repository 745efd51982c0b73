"""The data stage: sources are read, cleaned, deduplicated, decontaminated and split (`run_clean`), and after
the tokenizer exists they are tokenized and packed into the trainer's token shards (`run_pack`). Modules:
sources (reading), clean (normalisation, quality rules, secrets), dedup (exact and MinHash/LSH), decontaminate
(n-gram overlap with evaluation sets, and the registry evaluation code fills), split, pack, card."""

from .decontaminate import (
    eval_texts_digest,
    eval_texts_for_decontamination,
    register_eval_texts,
    registered_eval_providers,
    unregister_eval_texts,
)
from .sources import DataSourceError

__all__ = [
    "DataSourceError",
    "eval_texts_digest",
    "eval_texts_for_decontamination",
    "register_eval_texts",
    "registered_eval_providers",
    "run_clean",
    "run_pack",
    "unregister_eval_texts",
]


def __getattr__(name: str):
    # Lazy: the stage's worker processes import stages.data.* and must not pay for torch (pack) or datatrove
    # (pipeline) unless they use them.
    if name == "run_clean":
        from .pipeline import run_clean

        return run_clean
    if name == "run_pack":
        from .pack import run_pack

        return run_pack
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
