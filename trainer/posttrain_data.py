"""Post-training data in the trainer: jsonl rows in three shapes, tokenised with the tokenizer's chat
template, with a loss mask that marks exactly the response tokens, packed into rows of seq_len + 1
(the mask travels with the tokens, so packing never puts a prompt token under the loss).

  SFT   {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
        or {"prompt": ..., "completion": ...}
  DPO   {"messages": [...the conversation before the answer...], "chosen": ..., "rejected": ...}
        or {"prompt": ..., "chosen": ..., "rejected": ...}
  GRPO  {"messages": [...], "answer": ...} or {"prompt": ..., "answer": ...}

The built-in data (generated from the verifiable task family's train split) is written in these
same shapes by the post-train stage, so user jsonl and built-in data take one path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .data import MicroBatch
from .loss import IGNORE_INDEX
from .objectives.dpo import PairBatch

ROLES = ("system", "user", "assistant")


def read_jsonl(path: str | Path, required: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Rows of a jsonl file; a row that is not an object or lacks a required key fails naming its line."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        missing = [k for k in required if k not in row]
        if missing:
            raise ValueError(f"{path}:{n}: missing key(s) {missing}; row has {sorted(row)}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def load_tokenizer(tokenizer_dir: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"tokenizer in {tokenizer_dir} has no chat template (tokenizer_config.json chat_template)")
    return tok


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"`messages` must be a non-empty list, got {messages!r:.80}")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"each message needs role in {ROLES} and a string content, got {m!r:.80}")
    return messages


def render(tok, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def conversation_segments(tok, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_response) pieces: each assistant turn is what the
    template renders after the generation prompt (`<|assistant|>\\n`) up to the end of that turn, so
    the response includes its end-of-turn marker (the model learns to stop)."""
    messages = _check_messages(messages)
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            head = render(tok, messages[:i], add_generation_prompt=True) if i else render(tok, [], True)
            if not head.startswith(done):
                raise ValueError("the chat template does not render conversations prefix by prefix")
            segments.append((head[len(done):], False))
            done = head
        full = render(tok, messages[: i + 1])
        if not full.startswith(done):
            raise ValueError("the chat template does not render conversations prefix by prefix")
        segments.append((full[len(done):], m["role"] == "assistant"))
        done = full
    return [(t, r) for t, r in segments if t]


def encode_segments(tok, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Each piece tokenised on its own (the prompt exactly as generation will see it), mask per token."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, is_response in segments:
        part = encode(tok, text)
        ids += part
        mask += [is_response] * len(part)
    return ids, mask


def encode_example(tok, row: dict[str, Any]) -> tuple[list[int], list[bool]]:
    """An SFT row -> (token ids, response mask)."""
    if "messages" in row:
        return encode_segments(tok, conversation_segments(tok, row["messages"]))
    if "prompt" in row and "completion" in row:
        ids, mask = encode_segments(tok, [((tok.bos_token or "") + row["prompt"], False), (row["completion"], True)])
        if tok.eos_token_id is not None:
            ids, mask = ids + [tok.eos_token_id], mask + [True]
        return ids, mask
    raise ValueError(f"an SFT row needs `messages` or `prompt` + `completion`; got keys {sorted(row)}")


def prompt_ids(tok, row: dict[str, Any]) -> list[int]:
    """What generation starts from: the conversation with the generation prompt, or bos + prompt."""
    if "messages" in row:
        return encode(tok, render(tok, _check_messages(row["messages"]), add_generation_prompt=True))
    if "prompt" in row:
        return encode(tok, (tok.bos_token or "") + row["prompt"])
    raise ValueError(f"a prompt row needs `messages` or `prompt`; got keys {sorted(row)}")


def pack(examples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int,
         packed: bool = True) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rows of seq_len + 1 tokens with their masks and document ids: examples laid end to end (greedy first
    fit in order), a longer example truncated, the tail padded with pad_id under mask False (in the
    last document: nothing attends to it, and it has no targets). The document ids let the model keep attention and positions inside each
    conversation (trainer/model/transformer.py document_positions_and_mask), as TRL's padding-free
    packing does with position ids: a packed row then trains exactly as its conversations would alone."""
    width = seq_len + 1
    rows: list[tuple[list[int], list[bool], list[int]]] = []
    for ids, mask in examples:
        ids, mask = ids[:width], mask[:width]
        if not packed or not rows or len(rows[-1][0]) + len(ids) > width:
            rows.append(([], [], []))
        doc = rows[-1][2][-1] + 1 if rows[-1][2] else 0
        rows[-1][0].extend(ids)
        rows[-1][1].extend(mask)
        rows[-1][2].extend([doc] * len(ids))
    out = []
    for ids, mask, docs in rows:
        pad = width - len(ids)
        out.append((np.array(ids + [pad_id] * pad, dtype=np.int64), np.array(mask + [False] * pad, dtype=bool),
                    np.array(docs + [docs[-1]] * pad, dtype=np.int64)))
    return out


def replay_rows(split_dir: str | Path, count: int, seq_len: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`count` windows of seq_len + 1 tokens of pretraining text (a packed split, trainer/shards.py), drawn
    without replacement in a seeded order, each under the loss on every token and as one document (the
    causal attention pretraining used): the replay rows SFT mixes into its batches so the model keeps
    modelling the text it was pretrained on (InstructGPT's pretraining mix, Ouyang et al. 2022)."""
    from .shards import PackedShards

    shards = PackedShards(split_dir)
    width = seq_len + 1
    per_row = shards.seq_len + 1
    if per_row < width:
        raise ValueError(f"replay: pretraining rows of {per_row} tokens are shorter than seq_len + 1 = {width}")
    windows = len(shards) * (per_row // width)
    if count > windows:
        raise ValueError(f"replay: {count} rows asked, {split_dir} holds {windows} windows of {width} tokens")
    picks = np.random.default_rng([seed, 7]).permutation(windows)[:count]
    out = []
    for w in picks:
        row, k = divmod(int(w), per_row // width)
        ids = shards.row(row)[k * width:(k + 1) * width]
        out.append((ids.astype(np.int64), np.ones(width, dtype=bool), np.zeros(width, dtype=np.int64)))
    return out


def replay_count(sft_rows: int, fraction: float) -> int:
    """Replay rows that make `fraction` of the mixed item list (so, in expectation, of every batch)."""
    return round(sft_rows * fraction / (1.0 - fraction)) if fraction > 0 else 0


def lm_batch(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]], ids: np.ndarray) -> MicroBatch:
    """inputs = row[:-1]; targets = row[1:] where the mask marks a response token, else IGNORE_INDEX;
    documents = the input tokens' document ids when some row holds more than one conversation."""
    tokens = torch.from_numpy(np.stack([rows[i][0] for i in ids]))
    mask = torch.from_numpy(np.stack([rows[i][1] for i in ids]))
    targets = tokens[:, 1:].clone()
    targets[~mask[:, 1:]] = IGNORE_INDEX
    docs = torch.from_numpy(np.stack([rows[i][2] for i in ids]))[:, :-1]
    # a single conversation per row needs only the causal mask
    documents = docs if bool((docs[:, :-1] != docs[:, 1:]).any()) else None
    return MicroBatch(inputs=tokens[:, :-1], targets=targets, rows=np.asarray(ids, dtype=np.int64),
                      documents=documents)


def encode_pair(tok, row: dict[str, Any]) -> tuple[tuple[list[int], list[bool]], tuple[list[int], list[bool]]]:
    """A DPO row -> (chosen ids/mask, rejected ids/mask), each the prompt plus that answer."""
    for key in ("chosen", "rejected"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"a DPO row needs string `chosen` and `rejected`; got keys {sorted(row)}")
    if "messages" in row:
        return tuple(encode_example(tok, {"messages": list(row["messages"]) + [{"role": "assistant", "content": row[k]}]})
                     for k in ("chosen", "rejected"))
    return tuple(encode_example(tok, {"prompt": row["prompt"], "completion": row[k]}) for k in ("chosen", "rejected"))


def pair_batch(pairs: list, ids: np.ndarray, pad_id: int) -> PairBatch:
    """b pairs -> a PairBatch of 2b right-padded rows (chosen first, then rejected)."""
    seqs = [pairs[i][0] for i in ids] + [pairs[i][1] for i in ids]
    S = max(len(s[0]) for s in seqs)
    tokens = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), S), dtype=torch.bool)
    for j, (t, m) in enumerate(seqs):
        tokens[j, :len(t)] = torch.tensor(t)
        mask[j, :len(m)] = torch.tensor(m)
    targets = tokens[:, 1:].clone()
    targets[~mask[:, 1:]] = IGNORE_INDEX
    return PairBatch(inputs=tokens[:, :-1], targets=targets, rows=np.asarray(ids, dtype=np.int64))


class ItemLoader:
    """Global batches of items (packed rows, pairs, prompts) in a seeded order per epoch, each data-parallel
    rank taking its contiguous slice and cutting it into micro-batches with `collate` (the same rule as
    trainer/data.py's PackedLoader, over an in-memory list)."""

    def __init__(self, items: list, *, global_batch_size: int, micro_batch_size: int, collate: Callable,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        if not items:
            raise ValueError("no training items")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*dp = "
                             f"{micro_batch_size}*{dp_size}")
        self.items, self.collate, self.seed = items, collate, seed
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.per_rank = dp_rank, global_batch_size // dp_size
        self.next_sample = 0
        self._perm_epoch, self._perm = -1, np.arange(0)

    def ids(self, start: int, count: int) -> np.ndarray:
        n = len(self.items)
        out = np.empty(count, dtype=np.int64)
        for i, g in enumerate(range(start, start + count)):
            if self._perm_epoch != g // n:
                self._perm_epoch, self._perm = g // n, np.random.default_rng([self.seed, g // n]).permutation(n)
            out[i] = self._perm[g % n]
        return out

    def next_ids(self) -> np.ndarray:
        ids = self.ids(self.next_sample + self.dp_rank * self.per_rank, self.per_rank)
        self.next_sample += self.global_batch_size
        return ids

    def next_step(self) -> list:
        ids = self.next_ids()
        b = self.micro_batch_size
        return [self.collate(ids[i:i + b]) for i in range(0, len(ids), b)]

    def __iter__(self):
        while True:
            yield self.next_step()

    @property
    def epoch(self) -> float:
        return self.next_sample / len(self.items)

    def state_dict(self) -> dict:
        return {"next_sample": self.next_sample, "seed": self.seed, "rows": len(self.items)}
