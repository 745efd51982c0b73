"""Templates of the offline lm-eval task suite: one YAML per task with `__DATA_DIR__` and
`__MAX_GEN_TOKS__` placeholders, and `utils.py` with the scoring hooks they name. The evaluate stage
fills them in and writes them, with their data files, into its output (stages/evaluate/suite.py)."""
