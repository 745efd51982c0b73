"""The tokenizer stage: a byte-level BPE (Sennrich et al. 2016; GPT-2's byte-level variant) trained with
Hugging Face `tokenizers` on the train split of the cleaned data, saved as Hugging Face tokenizer files
(tokenizer.json + tokenizer_config.json with the special tokens and a Jinja chat template) that
`transformers.AutoTokenizer.from_pretrained(dir)` loads.

Byte-level pre-tokenisation with no normaliser makes the round trip exact for any text: every byte has a
token, and decoding maps tokens back to the same bytes. No BOS/EOS is added by `encode`; the packer appends
EOS after each document and the chat template writes BOS and the role markers itself.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any


from .base import StageContext
from .data.card import DataCard
from .data.pipeline import iter_split_texts, split_files

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, *ROLE_TOKENS]  # ids 0..6, in this order

# Each message: <|role|>\n content <|end|>\n ; generation starts after "<|assistant|>\n". The five roles
# of OpenAI's chat API render onto the three role tokens the model is trained with: a developer message
# (OpenAI's newer name for the system message) is a system turn, a tool result is a user turn wrapped in
# <tool_response> (Qwen2.5's convention), an assistant's tool calls follow its text as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> blocks separated by newlines (the Hermes
# format vLLM's `hermes` tool parser reads; exactly what stages/serve/tools.py's render_tool_call writes,
# its grammar forces and its parser reads back), and a `tools` list is a first system turn holding each
# function's JSON schema. Content may be a string or a list of text parts (joined by newlines, as vLLM
# joins them for a string template); anything else raises, naming what it cannot render.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|system|>\\n# Tools\\nTo call a function, reply with <tool_call>\\n{\"name\": <function name>, "
    "\"arguments\": <JSON object>}\\n</tool_call> for each call. The functions:\\n' }}"
    "{% for tool in tools %}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\\n' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = message['role'] %}"
    "{% if role not in ['system', 'developer', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('chat roles are system, developer, user, assistant and tool, got ' + role|string) }}"
    "{% endif %}"
    "{% set content = message['content'] if message['content'] is defined and message['content'] is not none else '' %}"
    "{% if content is not string %}"
    "{% set joined = namespace(text='') %}"
    "{% for part in content %}"
    "{% if part['type'] != 'text' or part['text'] is not string %}"
    "{{ raise_exception('only text content parts can be rendered, got a part of type ' + part['type']|string) }}"
    "{% endif %}"
    "{% set joined.text = joined.text + ('' if loop.first else '\\n') + part['text'] %}"
    "{% endfor %}"
    "{% set content = joined.text %}"
    "{% endif %}"
    "{% if role == 'assistant' %}"
    "{{ '<|assistant|>\\n' + content }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if fn['name'] is not string %}{{ raise_exception('a tool call needs a function name') }}{% endif %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + fn['name'] | tojson + ', \"arguments\": ' }}"
    "{{ fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson }}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>\\n' }}"
    "{% elif role == 'tool' %}"
    "{{ '<|user|>\\n<tool_response>' + content + '</tool_response><|end|>\\n' }}"
    "{% else %}"
    "{{ '<|' + ('system' if role == 'developer' else role) + '|>\\n' + content + '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
END_OF_TURN = "<|end|>"  # closes every turn: a stop token wherever the model goes (export, GGUF, serve)


def train_bpe(texts, vocab_size: int, min_frequency: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        # The library's own bars (Rust, indicatif): documents read, words, pair counts, merges. They draw
        # on file descriptor 2 only when it is a terminal, but each phase still prints an empty line to
        # stdout; so they are asked for only on a terminal, and CI and Prefect workers' logs get nothing.
        show_progress=os.isatty(2),
    )
    tok.train_from_iterator(texts, trainer, length=len(texts) if hasattr(texts, "__len__") else None)
    return tok


def save_hf(tok, out_dir: Path) -> None:
    """Hugging Face files; the chat template goes into tokenizer_config.json, and the class is the generic
    fast tokenizer so older transformers and serving engines load it too."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                 extra_special_tokens=list(ROLE_TOKENS))
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir), save_jinja_files=False)
    cfg_path = out_dir / "tokenizer_config.json"
    conf = json.loads(cfg_path.read_text())
    conf["tokenizer_class"] = "PreTrainedTokenizerFast"
    conf["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(conf, indent=2))


def load_tokenizer(tok_dir: Path):
    """The `tokenizers.Tokenizer` of a tokenizer artifact and its EOS id."""
    from tokenizers import Tokenizer

    path = Path(tok_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {tok_dir} the output of the tokenizer stage?")
    tok = Tokenizer.from_file(str(path))
    conf_path = Path(tok_dir) / "tokenizer_config.json"
    eos = json.loads(conf_path.read_text()).get("eos_token", EOS) if conf_path.is_file() else EOS
    eos = eos["content"] if isinstance(eos, dict) else eos
    eos_id = tok.token_to_id(eos)
    if eos_id is None:
        raise ValueError(f"{path}: EOS token {eos!r} is not in the vocabulary")
    return tok, eos_id


def token_stats(tok, texts: list[str], top: int = 20) -> dict[str, Any]:
    """Bytes per token and the most frequent tokens over `texts` (special tokens are encoded as text)."""
    tok.encode_special_tokens = True
    counts: Counter = Counter()
    n_tokens = n_bytes = 0
    for i in range(0, len(texts), 256):
        batch = texts[i:i + 256]
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            counts.update(enc.ids)
            n_tokens += len(enc.ids)
        n_bytes += sum(len(t.encode("utf-8", "surrogatepass")) for t in batch)
    rows = [{"id": i, "token": repr(tok.decode([i])), "count": c, "share": c / max(1, n_tokens)}
            for i, c in counts.most_common(top)]
    return {"tokens": n_tokens, "bytes": n_bytes, "bytes_per_token": n_bytes / max(1, n_tokens), "top": rows}


def run(ctx: StageContext) -> dict[str, Any]:
    tcfg = ctx.cfg.tokenizer
    data_dir = ctx.inputs.get("data")
    if data_dir is None:
        raise ValueError("tokenizer stage needs inputs['data'] (the cleaned-data artifact folder)")
    split_files(data_dir, "train")  # validate before training
    split_files(data_dir, "validation")
    t0 = time.perf_counter()
    train_texts = list(iter_split_texts(data_dir, "train", tcfg.train_bytes))
    if not train_texts:
        raise ValueError(f"{data_dir}/train holds no documents")
    tok = train_bpe(train_texts, tcfg.vocab_size, tcfg.min_frequency)
    train_s = time.perf_counter() - t0
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    save_hf(tok, ctx.out_dir)

    val = token_stats(tok, list(iter_split_texts(data_dir, "validation")))
    vocab = tok.get_vocab_size()
    summary = {
        "vocab_size": vocab,
        "vocab_size_requested": tcfg.vocab_size,
        "train_documents": len(train_texts),
        "train_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in train_texts),
        "validation_tokens": val["tokens"],
        "validation_bytes": val["bytes"],
        "validation_bytes_per_token": round(val["bytes_per_token"], 4),
        "train_seconds": round(train_s, 3),
    }
    card = DataCard("Tokenizer card: byte-level BPE")
    card.figures("summary", "Summary", summary)
    card.table("special_tokens", "Special tokens", [{"token": t, "id": tok.token_to_id(t)} for t in SPECIAL_TOKENS],
               ["token", "id"])
    card.table("top_tokens", "Most frequent tokens on validation", val["top"], ["id", "token", "count", "share"])
    card.raw("chat_template", CHAT_TEMPLATE)
    md = card.write(ctx.out_dir, "tokenizer_card")
    ctx.log_params({"tokenizer.vocab_size": tcfg.vocab_size, "tokenizer.min_frequency": tcfg.min_frequency,
                    "tokenizer.kind": tcfg.kind})
    ctx.log_metrics({f"tokenizer.{k}": float(v) for k, v in summary.items()}, None)
    ctx.log_artifact(md)
    if vocab < tcfg.vocab_size:
        summary["note"] = f"corpus too small for {tcfg.vocab_size} entries: learned {vocab}"
    return summary


__all__ = ["BOS", "CHAT_TEMPLATE", "END_OF_TURN", "EOS", "PAD", "ROLE_TOKENS", "SPECIAL_TOKENS", "load_tokenizer", "run", "save_hf",
           "token_stats", "train_bpe"]

