"""The offline suite loads and runs with the network off, and gives the same numbers through our
`eightfold` model (serving engine), lm-eval's own `hf` model on the same checkpoint - one written by the
export stage's writer - and lm-eval's `local-completions` model against the `eightfold serve` HTTP server:
per-example log-likelihoods within 1e-3, perplexities within 1e-3 (relative), and identical greedy
generations and exact match."""

from __future__ import annotations

import math
import os

import pytest

from eval_variants import stdlib_sources
from infra.config.evaluate import SUITE_TASKS, EvaluateConfig

WINDOW = 96  # tokens per scoring window, the same for every model under test
LIMIT = 6


@pytest.fixture(scope="module")
def suite(tmp_path_factory, tiny_hf_model_dir):
    from transformers import AutoTokenizer

    from stages.evaluate.suite import task_manager, token_window_filter, write_suite

    cfg = EvaluateConfig(limit=LIMIT, max_gen_toks=8, heldout_examples=20, ppl_max_docs=4, ppl_max_chars=700,
                         code_max_functions=10, code_max_body_chars=300, bootstrap_iters=50)
    tok = AutoTokenizer.from_pretrained(str(tiny_hf_model_dir))
    out, counts = write_suite(tmp_path_factory.mktemp("suite"), cfg, stdlib_sources(10), token_window_filter(tok, WINDOW))
    assert counts["heldout_ppl"] == 4 and counts["code_completion"] >= LIMIT
    yaml = (out / "eightfold_arith.yaml").read_text()
    assert str(out) not in yaml and "data_file: arithmetic.jsonl" in yaml  # found beside utils.py, whatever the cwd
    return cfg, task_manager(out, cfg.tasks)


@pytest.fixture(scope="module")
def exported_dir(tiny_hf_model_dir, tmp_path_factory):
    """A checkpoint written by the export stage's own writer (bf16 safetensors, config, tokenizer) from
    our trainer's model definition, not by transformers."""
    import torch

    from infra.config.model import ModelConfig
    from stages.export.hf import write_hf
    from trainer.model import Transformer

    cfg = ModelConfig(vocab_size=1024, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128,
                      init_std=0.2)  # a wide init: confident logits, so greedy choices are not near-ties
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("export") / "hf"
    write_hf(Transformer(cfg).state_dict(), cfg, out, dtype="bfloat16", tokenizer_dir=tiny_hf_model_dir)
    return out



def _run(model, model_args, suite, cwd):
    from stages.evaluate.run import evaluate_model

    cfg, tm = suite
    old = os.getcwd()
    os.chdir(cwd)  # relative paths would break here: the YAML must not depend on the cwd
    try:
        return evaluate_model(model, list(SUITE_TASKS), tm, cfg, model_args=model_args)
    finally:
        os.chdir(old)


@pytest.fixture(scope="module")
def ours(suite, exported_dir, tmp_path_factory):
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"
    return _run("eightfold", {"pretrained": str(exported_dir), "max_length": WINDOW, "max_gen_toks": 8,
                              "batch_size": 8}, suite, tmp_path_factory.mktemp("cwd"))


def _resps(raw, task):
    return [s["filtered_resps"] for s in sorted(raw["samples"][task], key=lambda s: s["doc_id"])]


def _same_numbers(ours, theirs):
    for task in SUITE_TASKS:
        a, b = ours["results"][task], theirs["results"][task]
        assert ours["n-samples"][task]["effective"] == theirs["n-samples"][task]["effective"]
        for key, va in a.items():
            if not isinstance(va, float) or "stderr" in key:
                continue
            vb = b[key]
            if "perplexity" in key:
                assert math.log(va) == pytest.approx(math.log(vb), abs=1e-3), (task, key)
            else:
                assert va == pytest.approx(vb, abs=1e-3), (task, key)
    generated = []
    for task in ("eightfold_arith", "eightfold_pyexpr"):
        assert _resps(ours, task) == _resps(theirs, task)  # identical greedy generations
        generated += [r[0] for r in _resps(ours, task)]
    assert sum(len(g) for g in generated) > 10  # and not trivially empty ones
    for task in ("eightfold_arith_mc", "eightfold_code_completion"):
        for ra, rb in zip(_resps(ours, task), _resps(theirs, task)):
            assert [r[0] for r in ra] == pytest.approx([r[0] for r in rb], abs=1e-3)


def test_suite_runs_offline_and_reports_every_task(ours):
    res = ours["results"]
    assert set(SUITE_TASKS) <= set(res)
    ppl = res["eightfold_heldout_ppl"]
    assert ppl["byte_perplexity,none"] == pytest.approx(2 ** ppl["bits_per_byte,none"], rel=1e-9)
    assert ppl["byte_perplexity,none"] > 1.0 and ppl["word_perplexity,none"] > ppl["byte_perplexity,none"]
    for task in ("eightfold_arith", "eightfold_pyexpr", "eightfold_arith_mc"):
        assert ours["n-samples"][task]["effective"] == LIMIT
    assert 0.0 <= res["eightfold_arith_mc"]["acc,none"] <= 1.0


def test_our_model_agrees_with_lm_evals_hf_model(ours, suite, exported_dir, tmp_path_factory):
    theirs = _run("hf", {"pretrained": str(exported_dir), "max_length": WINDOW, "dtype": "float32",
                         "batch_size": 4, "device": "cpu"}, suite, tmp_path_factory.mktemp("cwd"))
    _same_numbers(ours, theirs)


def test_our_model_agrees_with_local_completions_against_eightfold_serve(ours, suite, exported_dir,
                                                                         tmp_path_factory):
    from stages.serve.server import ServerThread, build_app, build_router

    router = build_router(str(exported_dir), num_kv_blocks=512).start()
    try:
        with ServerThread(build_app(router)) as srv:
            # local-completions keeps one token for the generated one and one for rolling context:
            # max_length = WINDOW + 2 gives the same windows as ours.
            args = {"model": router.model_names()[0], "base_url": f"{srv.url}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": str(exported_dir),
                    "tokenized_requests": True, "max_length": WINDOW + 2, "max_gen_toks": 8, "num_concurrent": 1}
            theirs = _run("local-completions", args, suite, tmp_path_factory.mktemp("cwd"))
    finally:
        router.shutdown()
    _same_numbers(ours, theirs)

