"""The committed suite works wherever it is copied: lm-eval's own CLI runs it from another folder, with
the folder it was written in gone and the current directory elsewhere, offline."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eval_variants import stdlib_sources
from infra.config.evaluate import EvaluateConfig

TASKS = ["eightfold_arith", "eightfold_code_completion"]  # generate_until, loglikelihood


@pytest.mark.slow  # 12-30 s on 2 cores: a fresh lm_eval process imports torch and transformers
def test_a_copied_suite_runs_with_lm_evals_cli_from_any_directory(tmp_path, tiny_hf_model_dir, caplog):
    from transformers import AutoTokenizer

    from stages.evaluate.suite import token_window_filter, write_suite

    cfg = EvaluateConfig(tasks=TASKS, max_gen_toks=4, heldout_examples=5, code_max_functions=4, code_max_body_chars=300)
    tok = AutoTokenizer.from_pretrained(str(tiny_hf_model_dir))
    written, counts = write_suite(tmp_path / "staging" / "suite", cfg, stdlib_sources(10), token_window_filter(tok, 96))
    assert counts["code_completion"] >= 3
    copy = tmp_path / "downloaded" / "suite"
    shutil.copytree(written, copy)
    shutil.rmtree(tmp_path / "staging")
    for f in copy.glob("*.yaml"):  # nothing in the suite names the folder it was written in
        assert str(tmp_path) not in f.read_text(), f.name

    cwd, out = tmp_path / "elsewhere", tmp_path / "results"
    cwd.mkdir()
    _loads_in_process_without_the_custom_dataset_warning(copy, cwd, caplog)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "lm_eval"), "--include_path", str(copy),
         "--tasks", ",".join(TASKS), "--model", "hf", "--model_args", f"pretrained={tiny_hf_model_dir},dtype=float32",
         "--limit", "3", "--device", "cpu", "--output_path", str(out)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = out.rglob("results_*.json")
    res = json.loads(result.read_text())["results"]
    assert set(res) == set(TASKS)
    assert isinstance(res["eightfold_arith"]["exact_match,none"], (int, float))
    assert res["eightfold_code_completion"]["bits_per_byte,none"] > 0
    assert isinstance(res["eightfold_code_completion"]["exact_match,none"], (int, float))


def _loads_in_process_without_the_custom_dataset_warning(suite, cwd, caplog):
    """The stage's way in (task_manager, in-process): the same rows as the data files, and lm-eval's
    warning about `custom_dataset` kwargs dropped for the suite's tasks only."""
    from stages.evaluate.suite import task_manager

    logger = logging.getLogger("lm_eval.api.task")
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with caplog.at_level(logging.WARNING, logger="lm_eval"):
            tasks = task_manager(suite, TASKS).load(TASKS)["tasks"]
    finally:
        os.chdir(old)
    assert not [r for r in caplog.records if "Custom kwargs" in r.getMessage()]
    for name, data in (("eightfold_arith", "arithmetic"), ("eightfold_code_completion", "code_completion")):
        rows = [json.loads(line) for line in (suite / "data" / f"{data}.jsonl").read_text().splitlines()]
        assert list(tasks[name].test_docs()) == rows

    def record(task):
        return logger.makeRecord(logger.name, logging.WARNING, __file__, 0,
                                 f"{task}: Custom kwargs can be passed to `--metadata` in console", None, None)
    assert not logger.filter(record("eightfold_arith")) and logger.filter(record("ruler_niah"))
    assert logger.filter(logger.makeRecord(logger.name, logging.WARNING, __file__, 0, "another warning", None, None))
