"""Hooks the suite's YAML files name with `!function utils.<name>` (copied next to the generated YAML
at stage run time): the dataset loader and the scoring hooks.

lm-eval imports this file from the YAML's folder, so `load_jsonl` finds `data/` beside it wherever the
suite is copied; a `data_files` path in the YAML would be resolved against the current directory instead."""

from pathlib import Path

from stages.evaluate.task_family import check

# resolved on import: lm-eval may name this file by a path relative to the current directory
DATA_DIR = Path(__file__).resolve().parent / "data"


def load_jsonl(data_file, split="test", **_metadata):
    """`custom_dataset`: the suite's `data/<data_file>` as a DatasetDict with one split, read by the
    `json` builder as `dataset_path: json` would. lm-eval calls it with the task's metadata and the
    command's `--metadata` as well as its `dataset_kwargs`; only the latter are used."""
    import datasets

    # a "Generating test split" bar per task and variant is noise for files of a few hundred rows
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset("json", data_files={split: str(DATA_DIR / data_file)})
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def exact_match_results(doc, results):
    """generate_until: 1 when the task family's exact checker accepts the generation."""
    return {"exact_match": int(check(results[0], doc["answer"]))}


def code_completion_results(doc, results):
    """loglikelihood of the body: bits per byte of the body, and whether greedy decoding reproduces it."""
    loglikelihood, is_greedy = results[0]
    return {"bits_per_byte": (loglikelihood, len(doc["body"].encode("utf-8"))), "exact_match": int(is_greedy)}
