"""The registered `eightfold` lm-eval model, each request type against log-probs computed here
directly with transformers + torch on the tiny checkpoint (no lm-eval, no engine in the reference)."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

CONTEXT = "def add(a, b):\n    "
CONTINUATION = "return a + b\n"
DOCUMENT = "import os\nimport sys\n\n\ndef main(argv):\n    return len(argv)\n" * 8


@pytest.fixture(scope="module")
def reference(tiny_hf_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_hf_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_model_dir), dtype=torch.float32).eval()
    return tok, model


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def lm(tiny_hf_model_dir):
    import stages.evaluate.lm_model  # noqa: F401  registers the name
    from lm_eval.api.registry import get_model

    return get_model("eightfold").create_from_arg_string(
        f"pretrained={tiny_hf_model_dir},max_length=48,max_gen_toks=12", {"batch_size": 4, "device": "cpu"}
    )


def test_registered_and_on_the_serving_engine(lm):
    from stages.serve.engine import LLMEngine

    assert isinstance(lm.backend.engine, LLMEngine)
    assert lm.max_length == 48 and lm.batch_size == 4


def test_loglikelihood_equals_hand_computed(lm, reference):
    tok, model = reference
    ctx_ids = tok.encode(CONTEXT.rstrip())  # lm-eval moves trailing whitespace into the continuation
    whole = tok.encode(CONTEXT + CONTINUATION)
    lp = _logprobs(model, whole)[len(ctx_ids) - 1:]
    want = float(lp.sum())
    # empty context: the prefix token (BOS) conditions the continuation
    ids = tok.encode(CONTINUATION)
    want_empty = float(_logprobs(model, [tok.bos_token_id] + ids).sum())
    got = lm.loglikelihood([Instance("loglikelihood", {}, (CONTEXT, CONTINUATION), 0),
                            Instance("loglikelihood", {}, ("", CONTINUATION), 1)], disable_tqdm=True)
    assert got[0][0] == pytest.approx(want, abs=1e-4)
    assert got[1][0] == pytest.approx(want_empty, abs=1e-4)
    assert got[0][1] is False  # a random model does not produce this body greedily


def test_greedy_flag_is_true_for_the_greedy_continuation(lm, reference):
    tok, model = reference
    ids = tok.encode("class Stack:")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False)[0, len(ids):].tolist()
    cont = tok.decode(out)
    assume_roundtrip = tok.encode("class Stack:" + cont)[len(ids):] == out
    if not assume_roundtrip:
        pytest.skip("greedy tokens do not re-tokenise to themselves on this random model")
    (ll, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, ("class Stack:", cont), 0)], disable_tqdm=True)
    assert greedy is True
    assert ll == pytest.approx(float(_logprobs(model, ids + out)[len(ids) - 1:].sum()), abs=1e-4)


def test_loglikelihood_rolling_equals_hand_computed_over_disjoint_windows(lm, reference):
    tok, model = reference
    ids = tok.encode(DOCUMENT)
    assert len(ids) > 2 * lm.max_length  # several windows
    # Windows of max_length predicted tokens; each sees the max_length tokens before its end (the
    # first sees BOS and what precedes), i.e. a sliding input of max_length tokens; sum the new ones.
    want, L, start = 0.0, lm.max_length, 0
    stream = [tok.bos_token_id] + ids
    while start < len(ids):
        end = min(start + L, len(ids))
        lo = max(0, end - L)  # input window stream[lo:end] predicts stream[lo+1:end+1]
        lp = _logprobs(model, stream[lo:end + 1])
        want += float(lp[start - lo:].sum())
        start = end
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (DOCUMENT,), 0)], disable_tqdm=True)
    assert got[0] == pytest.approx(want, abs=1e-3)
    # one window: the whole text at once
    short = "x = 1\n"
    got_short = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)], disable_tqdm=True)
    assert got_short[0] == pytest.approx(float(_logprobs(model, [tok.bos_token_id] + tok.encode(short)).sum()), abs=1e-4)


def test_generate_until_equals_hand_greedy_decoding_cut_at_the_stop_string(lm, reference):
    tok, model = reference
    prompts = ["def main(", "import os\n", "class Config:"]
    want = []
    for p in prompts:
        ids = tok.encode(p)
        out: list[int] = []
        with torch.no_grad():
            for _ in range(12):  # greedy, one token at a time, no cache
                nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
                out.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        text = tok.decode(out, skip_special_tokens=True)
        want.append(text.split("e")[0])
    reqs = [Instance("generate_until", {}, (p, {"until": ["e"], "max_gen_toks": 12, "do_sample": False}), i)
            for i, p in enumerate(prompts)]
    assert lm.generate_until(reqs, disable_tqdm=True) == want


def test_arguments_are_checked(tiny_hf_model_dir):
    from stages.evaluate.lm_model import EightfoldLM

    with pytest.raises(ValueError, match="needs pretrained"):
        EightfoldLM()
    with pytest.raises(ValueError, match="max_length=999999 exceeds"):
        EightfoldLM(pretrained=str(tiny_hf_model_dir), max_length=999999)
    with pytest.raises(ValueError, match="unknown backend 'vllm'"):
        EightfoldLM(pretrained=str(tiny_hf_model_dir), backend="vllm")


def test_an_engine_already_running_in_process_can_be_evaluated(lm):
    """GRPO and the server hold an engine already: the model wraps it instead of loading another."""
    from stages.evaluate.backends import EngineBackend
    from stages.evaluate.lm_model import EightfoldLM

    shared = EightfoldLM(backend=EngineBackend(engine=lm.backend.engine), max_length=48)
    req = [Instance("loglikelihood", {}, ("import os\n", "import sys\n"), 0)]
    assert shared.loglikelihood(req, disable_tqdm=True) == lm.loglikelihood(req, disable_tqdm=True)


def test_chat_template_renders_as_the_tokenizer_does(lm, reference):
    tok, _ = reference
    chat = [{"role": "user", "content": "Q: What is 2 + 3?\nA:"}]
    assert lm.apply_chat_template(chat) == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "<|assistant|>" in lm.apply_chat_template(chat)
