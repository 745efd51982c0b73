"""Our post-training losses against TRL's own (TRL 1.16's trainers' `_compute_loss`) on the same model and
batch. The model is ours exported to the Hugging Face layout, which TRL loads, with a perturbed reference;
the loss and the gradient of every weight (mapped to Hugging Face names) must agree to 1e-5.
- GRPO, every loss_type (dapo, grpo, dr_grpo) at a sampling temperature that is not 1, with clip-higher and
  the KL term, on the same behaviour log-probs.
- DPO, sigmoid and IPO. (Our rpo_alpha term is the chosen answers' per-answer mean NLL; TRL's "sft" term
  averages all chosen tokens of the batch, so the two differ when lengths do: not compared.)"""

from __future__ import annotations

import copy

import pytest
import torch

from fixtures.trainer_data import tiny_config
from stages.export import hf as hf_layout
from trainer.model import Transformer
from trainer.loss import IGNORE_INDEX
from trainer.objectives.dpo import DirectPreference, PairBatch
from trainer.objectives.grpo import GroupRelativePolicy, Rollout, rollout_batches

pytestmark = pytest.mark.filterwarnings("ignore")

TEMPERATURE, BETA, EPS, EPS_HIGH, MAX_NEW = 0.7, 0.04, 0.2, 0.28, 5
PROMPT_LEN, COMPLETIONS = 3, (5, 3, 4, 1)  # one group of 4 answers of these lengths


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(our policy, our reference (perturbed), the policy's HF folder, the reference's HF state dict)."""
    cfg = tiny_config().model
    torch.manual_seed(0)
    policy = Transformer(cfg)
    reference = copy.deepcopy(policy).requires_grad_(False)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp("hf")
    hf_layout.write_hf(policy.state_dict(), cfg, folder, dtype="float32")
    arch = hf_layout.hf_architecture(cfg)
    return cfg, policy, reference, folder, hf_layout.to_hf_state_dict(reference.state_dict(), cfg, arch, torch.float32)


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1")


def _grads_in_hf_names(model, cfg) -> dict[str, torch.Tensor]:
    arch = hf_layout.hf_architecture(cfg)
    return hf_layout.to_hf_state_dict({k: p.grad for k, p in model.named_parameters()}, cfg, arch, torch.float32)


def _assert_same(our_loss, our_grads, trl_loss, trl_model):
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    assert our_loss.abs().item() > 1e-3
    trl_grads = {k: p.grad for k, p in trl_model.named_parameters() if p.grad is not None}
    assert set(our_grads) == set(trl_grads)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def _trl_trainer(folder, loss_type: str, vocab: int, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = _tokenizer(vocab)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), loss_type=loss_type, beta=BETA, temperature=TEMPERATURE,
                      epsilon=EPS, epsilon_high=EPS_HIGH, max_completion_length=MAX_NEW, num_generations=4,
                      per_device_train_batch_size=4, report_to=[], use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=str(folder), reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=args, train_dataset=Dataset.from_list([{"prompt": "t2 t3 t4"}] * 4),
                          processing_class=tok)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop, which this test does not run
    return trainer


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_our_grpo_loss_and_gradients_equal_trls(models, loss_type, tmp_path):
    cfg, policy, reference, folder, ref_hf = models
    policy = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, cfg.vocab_size, (PROMPT_LEN,), generator=g).tolist()
    answers = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in COMPLETIONS]
    advantages = torch.tensor([1.0, -0.5, 0.3, -0.8])
    ours = GroupRelativePolicy(epsilon=EPS, epsilon_high=EPS_HIGH, beta=BETA, reference=reference,
                               temperature=TEMPERATURE, loss_type=loss_type, max_new_tokens=MAX_NEW)
    (batch,), _ = rollout_batches([[Rollout(prompt, a, [0.0] * len(a), "") for a in answers]], [[0.0] * 4],
                                  micro_batch_size=4, pad_id=0)
    batch.advantages = advantages  # the test's own, not group-normalised rewards
    # behaviour log-probs: the policy's own at T, moved by up to +-0.4, so some ratios are clipped and some not
    with torch.no_grad():
        now = ours._token_logps(policy, batch, torch.device("cpu"))
    batch.old_logps = now + (torch.rand(now.shape, generator=g) - 0.5) * 0.8
    old = [batch.old_logps[i, PROMPT_LEN - 1:PROMPT_LEN - 1 + len(a)].tolist() for i, a in enumerate(answers)]
    part = ours.loss(policy, batch, torch.device("cpu"))
    assert 0 < ours.stats["clipped"] < sum(COMPLETIONS)
    our_loss = part.ce_sum / ours.weight(batch)  # what the training loop divides by (one micro-batch, one rank)
    our_loss.backward()
    our_grads = _grads_in_hf_names(policy, cfg)

    trainer = _trl_trainer(folder, loss_type, cfg.vocab_size, tmp_path)
    trainer.model.train()
    trainer.ref_model.load_state_dict(ref_hf, strict=False)
    completion_ids = torch.zeros(4, MAX_NEW, dtype=torch.long)
    completion_mask = torch.zeros(4, MAX_NEW, dtype=torch.long)
    old_logps = torch.zeros(4, MAX_NEW)
    for i, (a, lp) in enumerate(zip(answers, old)):
        completion_ids[i, :len(a)], completion_mask[i, :len(a)], old_logps[i, :len(a)] = torch.tensor(a), 1, torch.tensor(lp)
    inputs = {"prompt_ids": torch.tensor([prompt] * 4), "prompt_mask": torch.ones(4, PROMPT_LEN, dtype=torch.long),
              "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": advantages,
              "old_per_token_logps": old_logps, "num_items_in_batch": completion_mask.sum().float()}
    with torch.no_grad():  # TRL's own reference log-probs at the temperature
        ids = torch.cat([inputs["prompt_ids"], completion_ids], 1)
        mask = torch.cat([inputs["prompt_mask"], completion_mask], 1)
        inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask,
                                                                                        MAX_NEW)
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()

    _assert_same(our_loss, our_grads, trl_loss, trainer.model)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_our_dpo_loss_and_gradients_equal_trls(models, kind, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    cfg, policy, reference, folder, ref_hf = models
    policy = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 4)]
    chosen = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (4, 2)]
    rejected = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (1, 3)]
    rows = [(p, a) for p, a in zip(prompts, chosen)] + [(p, a) for p, a in zip(prompts, rejected)]
    L = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.zeros(len(rows), L, dtype=torch.long)
    attention = torch.zeros(len(rows), L, dtype=torch.long)
    completion = torch.zeros(len(rows), L, dtype=torch.long)
    targets = torch.full((len(rows), L - 1), IGNORE_INDEX, dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        n = len(p) + len(a)
        input_ids[i, :n], attention[i, :n], completion[i, len(p):n] = torch.tensor(p + a), 1, 1
        targets[i, len(p) - 1:n - 1] = torch.tensor(a)

    ours = DirectPreference(beta=0.1, kind=kind, reference=reference)
    batch = PairBatch(inputs=input_ids[:, :-1], targets=targets, rows=torch.arange(len(rows)).numpy())
    part = ours.loss(policy, batch, torch.device("cpu"))
    our_loss = part.ce_sum / ours.weight(batch)
    our_loss.backward()

    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.1, loss_type=[kind], report_to=[], use_cpu=True,
                     bf16=False, per_device_train_batch_size=2)
    trainer = DPOTrainer(model=str(folder), args=args, processing_class=_tokenizer(cfg.vocab_size),
                         train_dataset=Dataset.from_list([{"prompt": "t2", "chosen": "t3", "rejected": "t4"}] * 2))
    trainer.ref_model.load_state_dict(ref_hf, strict=False)
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, {"input_ids": input_ids, "attention_mask": attention,
                                                     "completion_mask": completion}, False)
    trl_loss.backward()
    _assert_same(our_loss, _grads_in_hf_names(policy, cfg), trl_loss, trainer.model)
