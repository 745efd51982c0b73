"""The evaluate stage hands its held-out problems to the data stage's decontamination, and a training
document that contains one is dropped by the data stage's own n-gram index."""

from __future__ import annotations

from infra.config import LifecycleConfig


def test_heldout_texts_reach_the_data_stage_and_match_contaminated_documents():
    import stages.evaluate  # noqa: F401  importing the stage registers its provider
    from stages.data.decontaminate import ContaminationIndex, eval_texts_for_decontamination, registered_eval_providers
    from stages.evaluate.decontam import PROVIDER, eval_texts
    from stages.evaluate.task_family import make_split

    cfg = LifecycleConfig.model_validate({"evaluate": {"heldout_examples": 5, "seed": 7}})
    assert PROVIDER in registered_eval_providers()
    texts = eval_texts_for_decontamination(cfg)
    held = make_split("python_expr", "heldout", 5, seed=7)
    assert all(e.text in texts for e in held)
    assert len(eval_texts(cfg)) == 10
    # Word 13-grams need long texts; at n=5 a training doc quoting a held-out problem is caught.
    index = ContaminationIndex(texts, n=5)
    arith = make_split("arithmetic", "heldout", 5, seed=7)[0]
    assert index.matches(f"some notes\n{arith.text}\nmore") is not None
    assert index.matches("Q: What is the answer?\nA: nothing here") is None
