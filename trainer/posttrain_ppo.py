"""PPO's batches in the post-training job (`posttrain.ppo`; the loss is objectives/ppo.py): each rollout batch
is sampled from the serving engine, scored by the frozen reward model, turned into per-token rewards with the
KL penalty to the SFT model, advantages (GAE, whitened over every rank) and value targets, and then cut into
`ppo_epochs` x `minibatches` optimizer steps. After the batch's last step the policy's new weights go into
the engine. Every `eval_every` rollout batches the greedy answers to held-out prompts are scored (the
task's checker and the reward model): PPO's held-out accuracy and reward, per step in MLflow."""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import posttrain_data as pdata
from .loss import IGNORE_INDEX
from .objectives.grpo import pad_rollouts
from .objectives.ppo import AdaptiveKL, PPOBatch, gae, masked_whiten, per_token_rewards, token_logps
from .objectives.reward import RewardModel


class RewardScorer:
    """The frozen reward model scoring answers as it was trained on them: the conversation (prompt, then the
    answer's text as the assistant's turn) rendered by the chat template, read at its last token."""

    def __init__(self, model: RewardModel, tok, pad_id: int, device: torch.device, batch_size: int = 64):
        self.model, self.tok, self.pad_id, self.device, self.batch_size = model, tok, pad_id, device, batch_size

    @torch.no_grad()
    def __call__(self, conversations: list[list[dict]], answers: list[str]) -> torch.Tensor:
        seqs = [pdata.encode_example(self.tok, {"messages": list(m) + [{"role": "assistant", "content": a.strip()}]})[0]
                for m, a in zip(conversations, answers)]
        out = []
        for start in range(0, len(seqs), self.batch_size):
            part = seqs[start:start + self.batch_size]
            tokens = torch.full((len(part), max(map(len, part))), self.pad_id, dtype=torch.long)
            for i, s in enumerate(part):
                tokens[i, :len(s)] = torch.tensor(s)
            last = torch.tensor([len(s) - 1 for s in part])
            out.append(self.model(tokens.to(self.device), last.to(self.device)).float().cpu())
        return torch.cat(out)


def _global_sum(values: list[float], group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.tolist()


class PPOBatches:
    """Yields (micro-batches, metrics) per optimizer step. `job` is the PosttrainJob (its model, engine,
    loader, tokenizer, settings and `push_weights`)."""

    def __init__(self, job, reference: nn.Module, scorer: RewardScorer, rows: list[dict], check: Callable,
                 heldout: list[dict]):
        self.job, self.s, self.reference, self.scorer = job, job.sc, reference, scorer
        self.rows, self.check, self.heldout = rows, check, heldout
        self.kl = AdaptiveKL(self.s.kl_coef, self.s.target_kl, self.s.kl_horizon)
        self.stop = set(job.stop_ids)
        self.batch_index = 0
        self.push_s = 0.0

    def _messages(self, row: dict) -> list[dict]:
        return row["messages"] if "messages" in row else [{"role": "user", "content": row["prompt"]}]

    @torch.no_grad()
    def _rollouts(self, ids) -> tuple[PPOBatch, dict[str, float]]:
        job, s = self.job, self.s
        t0 = time.perf_counter()
        prompts = [job.prompts[i][0] for i in ids]
        groups = job.engine.generate(prompts, s.samples_per_prompt, s.max_new_tokens, s.temperature,
                                     seed=job.seed * 100003 + int(ids[0]) * 7919 + self.batch_index)
        gen_s = time.perf_counter() - t0
        flat = [(i, r) for i, g in zip(ids, groups) for r in g]
        inputs, targets = pad_rollouts([(r.prompt_ids, r.completion_ids) for _, r in flat], job.pad_id)
        device = job.device
        inputs, targets = inputs.to(device), targets.to(device)
        mask = targets != IGNORE_INDEX
        job.model.eval()
        logits, values = job.model(inputs)  # the rollout policy and critic: every layout's forward
        logps = token_logps(logits, targets, s.temperature)
        ref = token_logps(self.reference(inputs), targets, s.temperature)
        values = values.float() * mask
        scores = self.scorer([self._messages(self.rows[i]) for i, _ in flat], [r.text for _, r in flat]).to(device)
        ended = torch.tensor([bool(r.completion_ids) and r.completion_ids[-1] in self.stop for _, r in flat], device=device)
        if s.missing_eos_penalty is not None:
            scores = scores - s.missing_eos_penalty * (~ended).float()
        rewards, kl = per_token_rewards(scores, logps, ref, mask, self.kl.value)
        if s.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, group=job.dp_group)
        adv, ret = gae(rewards, values, mask, s.gamma, s.lam)
        adv = masked_whiten(adv, mask, group=job.dp_group)
        right = [float(self.check(r.text, job.prompts[i][1])) for i, r in flat]
        n, tokens = len(flat), float(mask.sum())
        sums = _global_sum([n, tokens, float(scores.sum()), float(kl.sum()), sum(right), float(ended.float().sum()),
                            float(values.sum())], job.dp_group)
        N = sums[0]
        kl_coef = self.kl.value
        self.kl.update(sums[3] / N, int(N))  # the per-sequence KL of the whole batch, every rank's
        metrics = {"score": sums[2] / N, "kl": sums[3] / N, "non_score_reward": -kl_coef * sums[3] / N,
                   "kl_coef": kl_coef, "accuracy": sums[4] / N, "ended": sums[5] / N, "response_length": sums[1] / N,
                   "value_mean": sums[6] / max(sums[1], 1.0), "rollout_s": gen_s, "weight_push_s": self.push_s}
        batch = PPOBatch(inputs=inputs.cpu(), targets=targets.cpu(), rows=torch.arange(n).numpy(),
                         old_logps=logps.cpu(), old_values=values.cpu(), advantages=adv.cpu(), returns=ret.cpu())
        return batch, metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy answers to the held-out prompts: accuracy by the task's checker, mean reward-model score."""
        job = self.job
        conv = [self._messages(r) for r in self.heldout]
        texts = job.engine.greedy([pdata.prompt_ids(job.tok, r) for r in self.heldout], self.s.max_new_tokens)
        right = [self.check(t, str(r["answer"])) for t, r in zip(texts, self.heldout)]
        scores = self.scorer(conv, texts)
        return {"heldout_accuracy": sum(right) / len(right), "heldout_reward": float(scores.mean())}

    def __iter__(self) -> Iterator[tuple[list[PPOBatch], dict[str, float]]]:
        job, s = self.job, self.s
        mb = s.micro_batch_size
        while True:
            batch, metrics = self._rollouts(job.loader.next_step()[0])
            if self.heldout and job.rank == 0 and s.heldout_every and self.batch_index % s.heldout_every == 0:
                metrics.update(self.evaluate())
            n = batch.inputs.shape[0]
            per_step = n // s.minibatches
            g = torch.Generator().manual_seed(job.seed * 1000003 + self.batch_index)
            for epoch in range(s.ppo_epochs):
                order = torch.randperm(n, generator=g)
                for k in range(s.minibatches):
                    sel = order[k * per_step:(k + 1) * per_step]
                    micro = [_select(batch, sel[i:i + mb]) for i in range(0, len(sel), mb)]
                    yield micro, {**metrics, "ppo_epoch": epoch}
            self.batch_index += 1
            t0 = time.perf_counter()
            job.push_weights()
            self.push_s = time.perf_counter() - t0


def _select(batch: PPOBatch, idx: torch.Tensor) -> PPOBatch:
    """The rows `idx` of a batch, trimmed to their longest sequence."""
    fields = {k: v[idx] for k, v in batch.__dict__.items() if isinstance(v, torch.Tensor)}
    targets = (fields["targets"] != IGNORE_INDEX).any(0).nonzero()
    width = int(targets.max()) + 1 if len(targets) else 1
    fields = {k: v[:, :width] for k, v in fields.items()}
    return PPOBatch(rows=batch.rows[idx.numpy()], **fields)
