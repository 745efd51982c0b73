"""Templates of the offline lm-eval task suite: one YAML per task with a `__MAX_GEN_TOKS__`
placeholder, and `utils.py` with the dataset loader and scoring hooks they name (the loader reads the
`data/` folder beside it, so the written suite has no paths in it). The evaluate stage fills them in and
writes them, with their data files, into its output (stages/evaluate/suite.py)."""
