"""Scoring hooks the suite's YAML files name with `!function utils.<name>` (copied next to the
generated YAML at stage run time)."""

from stages.evaluate.task_family import check


def exact_match_results(doc, results):
    """generate_until: 1 when the task family's exact checker accepts the generation."""
    return {"exact_match": int(check(results[0], doc["answer"]))}


def code_completion_results(doc, results):
    """loglikelihood of the body: bits per byte of the body, and whether greedy decoding reproduces it."""
    loglikelihood, is_greedy = results[0]
    return {"bits_per_byte": (loglikelihood, len(doc["body"].encode("utf-8"))), "exact_match": int(is_greedy)}
