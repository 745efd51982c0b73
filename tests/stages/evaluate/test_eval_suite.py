"""Writing the suite: held-out text from either data artifact, functions split at the docstring."""

from __future__ import annotations

import pytest

from stages.evaluate.suite import EvaluationDataError, python_functions, validation_texts


def test_validation_text_from_packed_tokens_decodes_the_documents(tiny_hf_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from trainer.shards import PackedShardWriter

    tok = AutoTokenizer.from_pretrained(str(tiny_hf_model_dir))
    docs = ["def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n", "class A:\n    pass\n" * 4]
    w = PackedShardWriter(tmp_path / "val", seq_len=16, vocab_size=len(tok), eos_id=tok.eos_token_id, rows_per_shard=1000)
    for d in docs:
        w.add(tok.encode(d))
    w.close()
    got = list(validation_texts({"tokens": tmp_path}, tok))
    assert got[:2] == docs[:2]  # the last document's tail may not fill a row and is dropped by packing
    with pytest.raises(EvaluationDataError, match="needs a 'data' or 'tokens' input"):
        list(validation_texts({"export": tmp_path}))


def test_python_functions_split_signature_and_docstring_from_the_body():
    src = (
        "import os\n\n"
        "class Box:\n"
        "    def size(self, n):\n"
        "        \"\"\"How big.\"\"\"\n"
        "        total = n * 2\n"
        "        return total\n\n"
        "def nodoc(x):\n    return x\n\n"
        "def only_doc():\n    \"\"\"Nothing else.\"\"\"\n"
    )
    (f,) = python_functions([src, "def broken(:\n"], 10, 500)
    assert f["prompt"] == "def size(self, n):\n    \"\"\"How big.\"\"\"\n"  # dedented to the def
    assert f["body"] == "    total = n * 2\n    return total\n"
    assert python_functions([src], 10, 10) == []  # body longer than the cap


def test_the_small_arithmetic_set_post_train_uses_can_be_evaluated(tmp_path):
    import json

    from infra.config.evaluate import EvaluateConfig
    from stages.evaluate.suite import write_suite
    from stages.evaluate.task_family import small_arithmetic

    cfg = EvaluateConfig(tasks=["eightfold_arith", "eightfold_arith_mc"], arithmetic_max_operand=9, arithmetic_ops="+",
                         heldout_examples=500)
    out, counts = write_suite(tmp_path, cfg, None)
    held = {e.question for e in small_arithmetic("heldout", 9, "+")}
    rows = [json.loads(line) for line in (out / "data" / "arithmetic.jsonl").read_text().splitlines()]
    assert counts["arithmetic"] == len(held) == len(rows) and {r["question"] for r in rows} == held
    assert (out / "eightfold_arith.yaml").exists() and not (out / "eightfold_heldout_ppl.yaml").exists()
