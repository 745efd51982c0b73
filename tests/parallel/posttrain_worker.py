"""Runs the post-training objectives (SFT, DPO with its frozen reference, GRPO on fixed rollouts, a reward
model's Bradley-Terry, PPO's actor and critic on fixed rollouts) for 3 steps of AdamW and of SGD on a tiny model under one parallel layout and records,
per objective: the losses and gradient norms, and the weights the job would hand its rollout engine
(`PosttrainJob.current_weights` and `weights_to_push`, gathered whole on every rank). Used in-process for
the one-process reference and under torchrun for every layout of one world size in a single launch.

    python -m torch.distributed.run --nproc-per-node=2 posttrain_worker.py OUT.pt LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import copy
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from trainer.data import MicroBatch
from trainer.loss import IGNORE_INDEX
from trainer.model import Transformer
from trainer.objectives import (BradleyTerry, DirectPreference, GroupRelativePolicy, PolicyAndValue, PPOBatch,
                                ProximalPolicy, RewardModel, SupervisedFineTuning)
from trainer.objectives.dpo import PairBatch
from trainer.objectives.grpo import Rollout, pad_rollouts, rollout_batches
from trainer.parallel import build_parallel_dims, parallelize
from trainer.parallel.ddp import unwrap
from trainer.parallel.zero1 import build_parallel_optimizer
from trainer.posttrain_job import PosttrainJob
from trainer.step import train_step

VOCAB, PAD, STEPS = 320, 0, 3  # tokenizer.vocab_size >= 300
OBJECTIVES = ("sft", "dpo", "grpo", "rm", "ppo")
SFT_ROWS, SFT_LEN, SFT_MICRO = 8, 12, 2  # rows per step, tokens per row, rows per micro-batch
PAIRS, PAIR_MICRO = 4, 1  # preference pairs per step, pairs per micro-batch (DPO and the reward model)
PROMPTS, GROUP, ROLLOUT_MICRO = 4, 2, 2  # GRPO: prompts per step, answers per prompt, answers per micro-batch
TEMPERATURE = 0.8

# name -> parallel: overrides (world size = dp * tp)
LAYOUTS = {
    "one": {},
    "ddp2": {"dp": 2},
    "zero1_dp2": {"dp": 2, "zero": 1},
    "fsdp_dp2": {"dp": 2, "zero": 3},
    "tp2": {"tp": 2},
}


def world_of(name: str) -> int:
    p = LAYOUTS[name]
    return p.get("dp", 1) * p.get("tp", 1)


def config(name: str, optimizer: str = "adamw") -> LifecycleConfig:
    return LifecycleConfig.model_validate({
        "name": "posttrain-layouts", "seed": 0,
        "model": {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                  "max_seq_len": 32, "qk_norm": True},
        "tokenizer": {"vocab_size": VOCAB},
        "parallel": {"nproc_per_node": world_of(name), "bucket_mb": 0.01, **LAYOUTS[name]},
        "pretrain": {"steps": STEPS, "seq_len": SFT_LEN, "micro_batch_size": SFT_MICRO,
                     "global_batch_size": SFT_ROWS, "lr": 1e-2 if optimizer == "adamw" else 0.5, "warmup_steps": 1,
                     "optimizer": optimizer, "weight_decay": 0.1,
                     "precision": "fp32", "grad_clip": 1.0, "peak_flops": 1e11, "activation_stats": False},
    })


# -- the data: every step's global batch, the same on every rank and layout; each dp rank takes its slice --
def _tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def sft_batches(step: int, dp_rank: int, dp: int) -> list[MicroBatch]:
    """Rows of a learnable pattern (a random walk over the vocabulary); the first 4 targets are the prompt."""
    g = torch.Generator().manual_seed(100 + step)
    start = torch.randint(0, VOCAB, (SFT_ROWS, 1), generator=g)
    rows = (start + torch.randint(1, 4, (SFT_ROWS, SFT_LEN + 1), generator=g).cumsum(1)) % VOCAB
    targets = rows[:, 1:].clone()
    targets[:, :4] = IGNORE_INDEX
    per = SFT_ROWS // dp
    lo = dp_rank * per
    return [MicroBatch(inputs=rows[i:i + SFT_MICRO, :-1], targets=targets[i:i + SFT_MICRO], rows=None)
            for i in range(lo, lo + per, SFT_MICRO)]


def _pair_batch(pairs: list[tuple[list[int], list[int], list[int]]]) -> PairBatch:
    """(prompt, chosen, rejected) token lists -> the chosen rows, then the rejected, right-padded."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    inputs, targets = pad_rollouts(rows, PAD)
    return PairBatch(inputs=inputs, targets=targets, rows=torch.arange(len(rows)).numpy())


def pair_batches(step: int, dp_rank: int, dp: int) -> list[PairBatch]:
    """Preference pairs of unequal prompt and answer lengths (so padding and last positions differ)."""
    g = torch.Generator().manual_seed(200 + step)
    pairs = [(_tokens(g, 2 + i % 3), _tokens(g, 3 + i % 2), _tokens(g, 2 + (i + 1) % 3)) for i in range(PAIRS)]
    per = PAIRS // dp
    mine = pairs[dp_rank * per:(dp_rank + 1) * per]
    return [_pair_batch(mine[i:i + PAIR_MICRO]) for i in range(0, per, PAIR_MICRO)]


def grpo_batches(step: int, dp_rank: int, dp: int, behaviour: torch.nn.Module) -> list:
    """Hand-made rollouts: answers of several lengths, fixed rewards, and behaviour log-probs from the
    starting model (nudged, so the first step is not exactly on-policy) at the sampling temperature."""
    g = torch.Generator().manual_seed(300 + step)
    groups, rewards = [], []
    for i in range(PROMPTS):
        prompt = _tokens(g, 3 + i % 2)
        group = []
        for j in range(GROUP):
            answer = _tokens(g, 2 + (i + j) % 3)
            with torch.no_grad():
                logits = behaviour(torch.tensor([prompt + answer[:-1]])).float() / TEMPERATURE
            logps = torch.log_softmax(logits[0, len(prompt) - 1:], -1).gather(-1, torch.tensor(answer)[:, None])
            noise = 0.05 * torch.randn(len(answer), generator=g)
            group.append(Rollout(prompt, answer, (logps.squeeze(-1) + noise).tolist(), text=""))
        groups.append(group)
        rewards.append(torch.rand(GROUP, generator=g).tolist())
    per = PROMPTS // dp
    lo = dp_rank * per
    return rollout_batches(groups[lo:lo + per], rewards[lo:lo + per], ROLLOUT_MICRO, PAD)[0]


def ppo_batches(step: int, dp_rank: int, dp: int, behaviour: torch.nn.Module) -> list[PPOBatch]:
    """Hand-made rollouts as PPO's job leaves them for the loss: behaviour log-probs of the starting model
    (nudged), and fixed rollout values, whitened-looking advantages and returns on the completion tokens;
    the whole step's rows are drawn first, so every layout's ranks cut the same ones."""
    g = torch.Generator().manual_seed(400 + step)
    rows = []
    for i in range(PROMPTS * GROUP):
        prompt, answer = _tokens(g, 3 + i % 2), _tokens(g, 2 + i % 3)
        with torch.no_grad():
            logits = behaviour(torch.tensor([prompt + answer[:-1]])).float() / TEMPERATURE
        logps = torch.log_softmax(logits[0, len(prompt) - 1:], -1).gather(-1, torch.tensor(answer)[:, None]).squeeze(-1)
        n = len(answer)
        rows.append((prompt, answer, logps + 0.05 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g),
                     torch.randn(n, generator=g), torch.randn(n, generator=g)))
    per = len(rows) // dp
    mine = rows[dp_rank * per:(dp_rank + 1) * per]
    out = []
    for start in range(0, per, ROLLOUT_MICRO):
        part = mine[start:start + ROLLOUT_MICRO]
        S = max(len(r[0]) + len(r[1]) for r in part) - 1
        inputs = torch.full((len(part), S), PAD, dtype=torch.long)
        targets = torch.full((len(part), S), IGNORE_INDEX, dtype=torch.long)
        old, values, adv, ret = (torch.zeros(len(part), S) for _ in range(4))
        for j, (p, a, lp, v, ad, rt) in enumerate(part):
            seq = p + a
            inputs[j, :len(seq) - 1] = torch.tensor(seq[:-1])
            span = slice(len(p) - 1, len(seq) - 1)
            targets[j, span] = torch.tensor(a)
            old[j, span], values[j, span], adv[j, span], ret[j, span] = lp, v, ad, rt
        out.append(PPOBatch(inputs=inputs, targets=targets, rows=None, old_logps=old, old_values=values,
                            advantages=adv, returns=ret))
    return out


# -- one objective under one layout ---------------------------------------------------------------------
def build(objective: str, cfg: LifecycleConfig) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The model to train and the frozen reference (a copy of the starting model, as PosttrainJob makes)."""
    torch.manual_seed(cfg.seed)
    base = Transformer(cfg.model)
    if objective == "rm":
        return RewardModel(base, cfg.model.dim), None
    reference = copy.deepcopy(base).eval().requires_grad_(False) if objective in ("dpo", "grpo", "ppo") else None
    if objective == "ppo":  # the critic: a reward model of its own trunk, as PPO starts it from the trained one
        return PolicyAndValue(base, RewardModel(Transformer(cfg.model), cfg.model.dim)), reference
    return base, reference


def make_objective(objective: str, reference):
    if objective == "sft":
        return SupervisedFineTuning()
    if objective == "dpo":
        return DirectPreference(beta=0.5, rpo_alpha=0.2, reference=reference)
    if objective == "grpo":
        return GroupRelativePolicy(epsilon=0.2, beta=0.05, reference=reference, temperature=TEMPERATURE)
    if objective == "ppo":
        return ProximalPolicy(cliprange=0.2, cliprange_value=0.2, vf_coef=0.5, temperature=TEMPERATURE)
    return BradleyTerry(center_rewards=0.01)


def batches(objective: str, step: int, dp_rank: int, dp: int, reference) -> list:
    if objective == "sft":
        return sft_batches(step, dp_rank, dp)
    if objective == "grpo":
        return grpo_batches(step, dp_rank, dp, reference)
    if objective == "ppo":
        return ppo_batches(step, dp_rank, dp, reference)
    return pair_batches(step, dp_rank, dp)


def run(name: str, objective: str, optimizer: str = "adamw") -> dict:
    cfg = config(name, optimizer)
    t = cfg.pretrain
    dims = build_parallel_dims(cfg.parallel, "cpu")
    model, reference = build(objective, cfg)
    model = parallelize(model, dims, cfg.parallel, t)
    optimizer = build_parallel_optimizer(unwrap(model), dims, cfg.parallel, t)
    loss_of = make_objective(objective, reference)
    losses, norms = [], []
    for step in range(t.steps):
        micro = batches(objective, step, dims.rank("dp"), dims.dp, reference)
        res = train_step(model, optimizer, micro, loss_of, t, step, torch.device("cpu"), dims.group("dp"))
        losses.append(res.loss)
        norms.append(res.grad_norm)
    # the job's own methods, on a stand-in holding just what they read (an engine that copies in place)
    job = SimpleNamespace(model=model, engine=SimpleNamespace(copies_in_place=True))
    return {"losses": losses, "grad_norms": norms, "weights": PosttrainJob.current_weights(job),
            "pushed": PosttrainJob.weights_to_push(job), "replica_drift": replica_drift(model),
            "reference": None if reference is None else reference_state(reference)}


def replica_drift(model: torch.nn.Module) -> float:
    """The largest difference between ranks of a parameter every rank holds whole (DDP's and ZeRO-1's
    replicas; under TP the replicated norms and heads): replicas that differ would drift apart."""
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized():
        return 0.0
    drift = 0.0
    for p in unwrap(model).parameters():
        if isinstance(p, DTensor) and not all(pl.is_replicate() for pl in p.placements):
            continue
        mine = (p.to_local() if isinstance(p, DTensor) else p).detach()
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine.contiguous())
        drift = max(drift, max(float((x - every[0]).abs().max()) for x in every))
    return drift


def reference_state(reference: torch.nn.Module) -> dict:
    """The frozen reference after training: still plain tensors (never parallelised) and its values."""
    from torch.distributed.tensor import DTensor

    return {"plain": not any(isinstance(p, DTensor) for p in reference.parameters()),
            "frozen": not any(p.requires_grad for p in reference.parameters()),
            "state": {k: v.detach().clone() for k, v in reference.state_dict().items()}}


def unaveraged_refusal() -> str | None:
    """ZeRO-1's layout with the plain optimizer (trainer.optim.build_optimizer) must not train silently: the
    message train_step refuses it with (None if it trained)."""
    from trainer.optim import build_optimizer

    cfg = config("zero1_dp2")
    dims = build_parallel_dims(cfg.parallel, "cpu")
    model = parallelize(build("sft", cfg)[0], dims, cfg.parallel, cfg.pretrain)
    try:
        train_step(model, build_optimizer(unwrap(model), cfg.pretrain), sft_batches(0, dims.rank("dp"), dims.dp),
                   SupervisedFineTuning(), cfg.pretrain, 0, torch.device("cpu"), dims.group("dp"))
    except ValueError as e:
        return str(e)
    return None


def run_all(names: list[str]) -> dict:
    """Per layout and objective: AdamW (the trainer's optimizer: losses, gradient norms) and SGD (the weights:
    an SGD step is the clipped gradient itself, where AdamW's would hide a gradient's scale, and amplify the
    last-bit differences of near-zero gradients into lr-sized ones)."""
    out = {n: {o: {opt: run(n, o, opt) for opt in ("adamw", "sgd")} for o in OBJECTIVES} for n in names}
    if "zero1_dp2" in names:
        out["unaveraged_refusal"] = unaveraged_refusal()
    return out


def main(out_file: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        results = run_all(names)
        if dist.get_rank() == 0:
            torch.save(results, out_file)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
