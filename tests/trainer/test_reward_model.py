"""The reward model (trainer/objectives/reward.py): exported as LlamaForSequenceClassification, transformers
scores every sequence as we do; our Bradley-Terry loss and every gradient equal TRL's RewardTrainer's
(`compute_loss`, TRL 1.16) on the same pairs, to 1e-5."""

from __future__ import annotations

import pytest
import torch

from fixtures.trainer_data import tiny_config
from stages.export import hf as hf_layout
from trainer.loss import IGNORE_INDEX
from trainer.model import Transformer
from trainer.objectives.dpo import PairBatch
from trainer.objectives.reward import BradleyTerry, RewardModel, whole_sequences

pytestmark = pytest.mark.filterwarnings("ignore")
PAD = 0


def _pairs(vocab: int):
    """(PairBatch, input_ids [4, L] right-padded with PAD, attention mask): two pairs of unequal lengths."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (3, 5)]
    chosen = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (4, 2)]
    rejected = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (1, 3)]
    rows = list(zip(prompts, chosen)) + list(zip(prompts, rejected))
    L = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((4, L), PAD, dtype=torch.long)
    mask = torch.zeros(4, L, dtype=torch.long)
    targets = torch.full((4, L - 1), IGNORE_INDEX, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        n = len(p) + len(a)
        ids[i, :n], mask[i, :n] = torch.tensor(p + a), 1
        targets[i, len(p) - 1:n - 1] = torch.tensor(a)
    return PairBatch(inputs=ids[:, :-1], targets=targets, rows=torch.arange(4).numpy()), ids, mask


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    cfg = tiny_config().model
    torch.manual_seed(0)
    model = RewardModel(Transformer(cfg), cfg.dim)
    folder = tmp_path_factory.mktemp("rm")
    hf_layout.write_reward_hf(model.trunk.state_dict(), model.score.weight, cfg, folder, dtype="float32",
                              pad_token_id=PAD)
    return cfg, model, folder


def test_transformers_scores_the_export_as_we_do(reward_model):
    from transformers import AutoModelForSequenceClassification

    cfg, model, folder = reward_model
    batch, ids, mask = _pairs(cfg.vocab_size)
    tokens, last = whole_sequences(batch)
    assert torch.equal(tokens[:, :ids.shape[1]] * mask, ids)  # the sequences, whole
    with torch.no_grad():
        ours = model(tokens, last)
        hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
        theirs = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_bradley_terry_loss_and_gradients_equal_trls_reward_trainer(reward_model, tmp_path):
    import copy

    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import RewardConfig, RewardTrainer

    cfg, model, folder = reward_model
    model = copy.deepcopy(model)
    batch, ids, mask = _pairs(cfg.vocab_size)
    objective = BradleyTerry()
    part = objective.loss(model, batch, torch.device("cpu"))
    our_loss = part.ce_sum / objective.weight(batch)
    our_loss.backward()
    assert set(objective.pop_metrics()) == {"preference_accuracy", "reward_margin", "rewards_chosen", "rewards_rejected"}

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t1"))
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")
    trainer = RewardTrainer(model=str(folder), args=RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[],
                                                                 use_cpu=True, bf16=False),
                            train_dataset=Dataset.from_list([{"chosen": "t2 t3", "rejected": "t2 t4"}] * 2),
                            processing_class=tok)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, {"input_ids": ids, "attention_mask": mask})
    trl_loss.backward()
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5)

    arch = hf_layout.hf_architecture(cfg)
    ours = hf_layout.to_hf_state_dict({k: p.grad for k, p in model.trunk.named_parameters() if p.grad is not None},
                                      cfg, arch, torch.float32)
    ours["score.weight"] = model.score.weight.grad
    theirs = {k: p.grad for k, p in trainer.model.named_parameters() if p.grad is not None}
    assert set(ours) == set(theirs)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
