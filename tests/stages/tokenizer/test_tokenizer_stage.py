"""The tokenizer stage on a small slice of real text: trained BPE, Hugging Face files that AutoTokenizer
loads with the chat template, and an exact round trip on unicode, whitespace and code."""

import json

import pytest

from infra.config import load_config
from infra.config.data import DataConfig, SourceConfig
from infra.workspace import Workspace
from stages.base import StageContext
from stages.data import run_clean
from stages.data.pipeline import iter_split_texts
from stages.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, run

VOCAB = 1024


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tok")
    cfg = load_config("tiny", [f"model.vocab_size={VOCAB}", f"tokenizer.vocab_size={VOCAB}"])
    cfg.data = DataConfig(sources=[SourceConfig(name="stdlib", kind="python_source", max_bytes=500_000, site_packages=False)],
                          val_fraction=0.1)
    cfg.infra.workdir = str(tmp / "ws")
    ws = Workspace.from_config(cfg)
    run_clean(StageContext(cfg, ws, tmp / "data"))
    metrics = {}
    summary = run(StageContext(cfg, ws, tmp / "tok", inputs={"data": tmp / "data"},
                               log_metrics=lambda m, step=None: metrics.update(m)))
    return tmp, summary, metrics


@pytest.fixture(scope="module")
def hf(artifacts):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(artifacts[0] / "tok"))


ROUND_TRIP = [
    "plain ascii text",
    "  leading and trailing spaces  ",
    "\t\ttabs\tand\nnew\r\nlines\r\rand\n\n\n\nblank lines\n",
    "unicode: héllo wörld, naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية",
    "emoji 🙂👍🏽👨‍👩‍👧‍👦 and symbols ∑∫√∞ ≠ ≤ ← → ©®™",
    "not NFC: cafe\u0301 and the ligature \ufb01 and full-width ＡＢＣ and nbsp\u00a0here",
    "zero width\u200bjoiner\u200d and bom \ufeff and control \x00\x01\x7f chars",
    "def f(x, *args, **kw):\n    return {k: v for k, v in kw.items() if v is not None}  # comment\n",
    "    if (a && b) || !c { x <<= 2; y >>= 3; } /* c-like */ `backticks` $var @decorator",
    "special markers as text: <|user|> <|eos|> <|end|>",
    "",
    " ",
    "a" * 5000,
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_is_exact(hf, text):
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(ids) == text


def test_round_trip_real_validation_text(artifacts, hf):
    for text in list(iter_split_texts(artifacts[0] / "data", "validation"))[:5]:
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text


def test_files_special_tokens_and_vocab(artifacts, hf):
    tmp, summary, metrics = artifacts
    conf = json.loads((tmp / "tok" / "tokenizer_config.json").read_text())
    assert conf["chat_template"] == CHAT_TEMPLATE
    assert summary["vocab_size"] == VOCAB == len(hf)
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert metrics["tokenizer.vocab_size"] == VOCAB


def test_chat_template(hf):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi 🙂<|end|>\n<|assistant|>\nHello.<|end|>\n"
                    "<|user|>\nBye<|end|>\n<|assistant|>\n")
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert ids[0] == hf.bos_token_id
    for role in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"):
        assert hf.convert_tokens_to_ids(role) in ids  # each marker is one token
    assert hf.decode(ids) == text
    with pytest.raises(Exception, match="chat roles"):
        hf.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_bytes_per_token_matches_a_recount(artifacts, hf):
    tmp, summary, _ = artifacts
    texts = list(iter_split_texts(tmp / "data", "validation"))
    n_bytes = sum(len(t.encode()) for t in texts)
    n_tokens = sum(len(hf.encode(t, add_special_tokens=False)) for t in texts)
    assert summary["validation_bytes_per_token"] == pytest.approx(n_bytes / n_tokens, rel=1e-3)
    assert summary["validation_bytes_per_token"] > 2.0  # BPE merged something: code compresses well past bytes
    card = json.loads((tmp / "tok" / "tokenizer_card.json").read_text())
    assert len(card["top_tokens"]) == 20 and card["top_tokens"][0]["count"] >= card["top_tokens"][-1]["count"]


def test_missing_data_input_is_named(tmp_path):
    cfg = load_config("tiny")
    cfg.infra.workdir = str(tmp_path / "ws")
    with pytest.raises(Exception, match="no part-\\*.parquet files"):
        run(StageContext(cfg, Workspace.from_config(cfg), tmp_path / "tok", inputs={"data": tmp_path / "nothing"}))
