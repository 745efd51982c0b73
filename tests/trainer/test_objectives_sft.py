"""SFT: the loss mask covers exactly the assistant tokens (also after packing), prompt/completion rows,
and the objective equals cross-entropy over the response positions computed by hand."""

import dataclasses

import numpy as np
import pytest
import torch

from fixtures.posttrain import make_chat_tokenizer, posttrain_config
from trainer import posttrain_data as pdata
from trainer.loss import IGNORE_INDEX
from trainer.model import Transformer
from trainer.objectives import SupervisedFineTuning

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "Q: What is 3 + 5?\nA:"},
    {"role": "assistant", "content": "8"},
    {"role": "user", "content": "And 12 + 30?"},
    {"role": "assistant", "content": "42, because 12 + 30 = 42."},
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return pdata.load_tokenizer(make_chat_tokenizer(tmp_path_factory.mktemp("chat-tok")))


def test_mask_covers_exactly_the_assistant_turns(tok):
    ids, mask = pdata.encode_example(tok, {"messages": CONVERSATION})
    assert len(ids) == len(mask)
    # The whole rendering is reproduced token for token (nothing lost at segment borders) ...
    assert tok.decode(ids) == pdata.render(tok, CONVERSATION)
    # ... and the masked tokens are exactly each assistant reply plus its end-of-turn marker, in order.
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert [tok.decode(s) for s in spans] == [r + "<|end|>\n" for r in replies]
    assert [s for s in spans] == [tok.encode(r + "<|end|>\n", add_special_tokens=False) for r in replies]
    # nothing of the system or user turns is under the loss
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    for m in CONVERSATION[:2] + CONVERSATION[3:4]:
        assert m["content"] in unmasked


def test_prompt_completion_rows(tok):
    ids, mask = pdata.encode_example(tok, {"prompt": "x = ", "completion": "41 + 1"})
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "41 + 1" + tok.eos_token
    assert tok.decode([i for i, m in zip(ids, mask) if not m]) == tok.bos_token + "x = "
    with pytest.raises(ValueError, match="messages"):
        pdata.encode_example(tok, {"text": "no"})
    with pytest.raises(ValueError, match="role"):
        pdata.encode_example(tok, {"messages": [{"role": "robot", "content": "hi"}]})


def test_mask_survives_packing(tok):
    rows = [{"messages": [{"role": "user", "content": f"Q: What is {a} + {a}?\nA:"},
                          {"role": "assistant", "content": str(2 * a)}]} for a in range(12)]
    examples = [pdata.encode_example(tok, r) for r in rows]
    packed = pdata.pack(examples, seq_len=63, pad_id=tok.pad_token_id)
    assert len(packed) < len(examples)  # several conversations share a row
    batch = pdata.lm_batch(packed, np.arange(len(packed)))
    # every target under the loss, read in row order, is exactly the concatenated response tokens
    got = [int(t) for row in batch.targets for t in row if t != IGNORE_INDEX]
    want = [i for ids, mask in examples for i, m in zip(ids, mask) if m]
    assert got == want
    assert torch.equal(batch.inputs[:, 1:], torch.from_numpy(np.stack([p[0] for p in packed]))[:, 1:-1])


def test_sft_loss_is_cross_entropy_on_response_positions(tok):
    cfg = posttrain_config()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    examples = [pdata.encode_example(tok, {"messages": CONVERSATION})] * 2
    batch = pdata.lm_batch(pdata.pack(examples, 127, tok.pad_token_id, packed=False), np.arange(2))
    obj = SupervisedFineTuning()
    part = obj.loss(model, batch, torch.device("cpu"))
    assert obj.weight(batch) == int(part.tokens) == 2 * sum(examples[0][1][1:])
    logits = model(batch.inputs)
    total = 0.0
    for b in range(2):
        for s in range(batch.inputs.shape[1]):
            t = int(batch.targets[b, s])
            if t != IGNORE_INDEX:
                total += -torch.log_softmax(logits[b, s].double(), -1)[t].item()
    assert part.ce_sum.item() == pytest.approx(total, rel=1e-5)


def test_packed_rows_train_as_their_conversations_alone(tok):
    """With document masking, each conversation's loss in a packed row equals its loss alone in a row of its
    own (positions restart, attention never crosses into the conversation before it); without the
    document ids the packed loss differs, which is the cross-contamination the masking removes."""
    cfg = posttrain_config()
    torch.manual_seed(0)
    model = Transformer(cfg.model).eval()
    rows = [{"messages": [{"role": "user", "content": f"Q: What is {a} + {a + 1}?\nA:"},
                          {"role": "assistant", "content": str(2 * a + 1)}]} for a in range(6)]
    examples = [pdata.encode_example(tok, r) for r in rows]
    obj = SupervisedFineTuning()
    packed = pdata.pack(examples, seq_len=95, pad_id=tok.pad_token_id)
    assert len(packed) < len(examples)
    batch = pdata.lm_batch(packed, np.arange(len(packed)))
    assert batch.documents is not None and int(batch.documents[0].max()) >= 1
    alone = pdata.lm_batch(pdata.pack(examples, 95, tok.pad_token_id, packed=False), np.arange(len(examples)))
    assert alone.documents is None
    with torch.no_grad():
        together, single = obj.loss(model, batch, torch.device("cpu")), obj.loss(model, alone, torch.device("cpu"))
        assert int(together.tokens) == int(single.tokens)
        assert together.ce_sum.item() == pytest.approx(single.ce_sum.item(), rel=1e-6)
        crossed = obj.loss(model, dataclasses.replace(batch, documents=None), torch.device("cpu"))
    # a random model is near uniform, so contamination moves its loss little; still 100x the tolerance above
    assert abs(crossed.ce_sum.item() - single.ce_sum.item()) > 1e-4 * single.ce_sum.item()


def test_document_positions_and_mask():
    from trainer.model.transformer import document_positions_and_mask

    pos, mask = document_positions_and_mask(torch.tensor([[0, 0, 0, 1, 1, 2]]))
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0]]
    m = mask[0, 0].int().tolist()
    assert m[4] == [0, 0, 0, 1, 1, 0] and m[2] == [1, 1, 1, 0, 0, 0] and m[5] == [0, 0, 0, 0, 0, 1]
