"""The two measurements every post-training step reports: held-out accuracy on the verifiable task
(greedy answers from the serving engine, judged by the task family's exact checker) and preference
accuracy (how often the model gives the right answer a higher log-likelihood than a near miss).

Both come with their outcome per item (problem or pair, in a fixed order), so a step's change is
judged against its noise: the binomial standard error of one accuracy, sqrt(p (1 - p) / n), and the
paired standard error of a change on the same items, sd(after_i - before_i) / sqrt(n), which is
smaller than the unpaired one because the items the two models agree on cancel."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from infra.config.model import ModelConfig
from infra.config.posttrain import TaskConfig
from stages.evaluate.task_family import check
from trainer import posttrain_data as pdata
from trainer.objectives.dpo import sequence_logps
from trainer.posttrain_job import stop_token_ids

from .data import heldout, user
from .rollout import ServingEngineRollouts


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy p measured on n independent items."""
    if n <= 0:
        raise ValueError(f"standard error of an accuracy on n={n} items")
    return math.sqrt(p * (1.0 - p) / n)


def paired_change(before: list[bool], after: list[bool]) -> tuple[float, float]:
    """(mean change, its standard error) of per-item outcomes measured twice on the same items."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired outcomes need the same non-empty items: {len(before)} before, {len(after)} after")
    d = [float(a) - float(b) for b, a in zip(before, after)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def outcome_bits(outcomes: list[bool]) -> str:
    """Per-item outcomes as a '0'/'1' string (kept in posttrain.json to pair steps later)."""
    return "".join("1" if x else "0" for x in outcomes)


def heldout_accuracy(sd: dict[str, torch.Tensor], model_cfg: ModelConfig, tokenizer_dir: Path, task: TaskConfig,
                     workdir: Path, seed: int = 0) -> dict:
    """Greedy accuracy on the task's held-out problems (the same set for every step)."""
    tok = pdata.load_tokenizer(tokenizer_dir)
    problems = heldout(task, seed)
    engine = ServingEngineRollouts(model_cfg=model_cfg, state_dict=sd, tokenizer_dir=tokenizer_dir, workdir=workdir,
                                   stop_token_ids=stop_token_ids(tok))
    prompts = [pdata.prompt_ids(tok, {"messages": user(e)}) for e in problems]
    texts = engine.greedy(prompts, task.max_new_tokens)
    correct = [check(t, e.answer) for t, e in zip(texts, problems)]
    acc = sum(correct) / len(correct)
    return {"accuracy": acc, "n": len(correct), "se": binomial_se(acc, len(correct)), "correct": correct, "texts": texts,
            "samples": [{"prompt": e.prompt, "expected": e.answer, "got": t} for e, t in list(zip(problems, texts))[:8]]}


def heldout_pairs(tok, task: TaskConfig, n_pairs: int | None, seed: int) -> list:
    """Encoded held-out pairs: each held-out problem's right answer against every near miss (off by 1, 2 or
    3 either way), up to n_pairs (None: all) in a fixed order."""
    rows = [{"messages": user(e), "chosen": e.answer, "rejected": str(int(e.answer) + d)}
            for d in (1, -1, 2, -2, 3, -3) for e in heldout(task, seed)][:n_pairs]
    return [pdata.encode_pair(tok, r) for r in rows]


@torch.no_grad()
def preference_accuracy(sd: dict[str, torch.Tensor], model_cfg: ModelConfig, tokenizer_dir: Path, task: TaskConfig,
                        n_pairs: int | None = None, seed: int = 0) -> dict:
    """Share of held-out pairs where log p(chosen) > log p(rejected) under the model. Each held-out
    problem gives every near miss (off by 1, 2 or 3 either way) as a rejected answer, up to n_pairs
    pairs (None: all of them) in a fixed order, so the measure does not hang on one random wrong
    answer per problem. The problems are the held-out ones, never DPO's training pairs."""
    from trainer.model import Transformer

    tok = pdata.load_tokenizer(tokenizer_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    pairs = heldout_pairs(tok, task, n_pairs, seed)
    model = Transformer(model_cfg)
    model.load_state_dict(sd)
    model.eval()
    wins: list[bool] = []
    for start in range(0, len(pairs), 64):
        chunk = pairs[start:start + 64]
        batch = pdata.pair_batch(chunk, list(range(len(chunk))), pad)
        logps, _ = sequence_logps(model(batch.inputs), batch.targets)
        wins += (logps[:len(chunk)] > logps[len(chunk):]).tolist()
    acc = sum(wins) / len(wins)
    return {"accuracy": acc, "n": len(wins), "se": binomial_se(acc, len(wins)), "wins": wins}


def load_reward_weights(folder: Path) -> dict[str, torch.Tensor]:
    """A reward model's tensors (`trunk.*`, `score.weight`) from its artifact's model.safetensors, as saved
    (not through the language-model loader, which keeps only a language model's names)."""
    from safetensors.torch import load_file

    path = Path(folder) / "model.safetensors" if Path(folder).is_dir() else Path(folder)
    sd = load_file(str(path))
    if "score.weight" not in sd:
        raise ValueError(f"{path} is not a reward model: it has no score.weight")
    return sd


def reward_model(sd: dict[str, torch.Tensor], model_cfg: ModelConfig):
    """A reward model (trainer/objectives/reward.py) holding `sd` (its trunk's and head's tensors)."""
    from trainer.model import Transformer
    from trainer.objectives.reward import RewardModel

    model = RewardModel(Transformer(model_cfg), model_cfg.dim)
    model.load_state_dict(sd)
    return model.eval()


@torch.no_grad()
def pairwise_accuracy(sd: dict[str, torch.Tensor], model_cfg: ModelConfig, tokenizer_dir: Path, task: TaskConfig,
                      n_pairs: int | None = None, seed: int = 0) -> dict:
    """The reward model's held-out pairwise accuracy: share of held-out pairs (preference_accuracy's) where it
    scores the right answer above the near miss, with the binomial standard error."""
    from trainer.objectives.reward import whole_sequences

    tok = pdata.load_tokenizer(tokenizer_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    pairs = heldout_pairs(tok, task, n_pairs, seed)
    model = reward_model(sd, model_cfg)
    wins: list[bool] = []
    margins: list[float] = []
    for start in range(0, len(pairs), 64):
        chunk = pairs[start:start + 64]
        tokens, last = whole_sequences(pdata.pair_batch(chunk, list(range(len(chunk))), pad))
        r = model(tokens, last)
        wins += (r[:len(chunk)] > r[len(chunk):]).tolist()
        margins += (r[:len(chunk)] - r[len(chunk):]).tolist()
    acc = sum(wins) / len(wins)
    return {"accuracy": acc, "n": len(wins), "se": binomial_se(acc, len(wins)), "wins": wins,
            "margin": sum(margins) / len(margins)}


@torch.no_grad()
def heldout_reward(sd: dict[str, torch.Tensor], model_cfg: ModelConfig, tokenizer_dir: Path, task: TaskConfig,
                   answers: list[str], seed: int = 0) -> dict:
    """The reward model's mean score of answers to the held-out problems (heldout_accuracy's greedy texts, in
    its order), each scored as the conversation the template renders, with the standard error of the mean."""
    from trainer.posttrain_ppo import RewardScorer

    tok = pdata.load_tokenizer(tokenizer_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    problems = heldout(task, seed)
    if len(answers) != len(problems):
        raise ValueError(f"{len(answers)} answers for {len(problems)} held-out problems")
    scores = RewardScorer(reward_model(sd, model_cfg), tok, pad, torch.device("cpu"))([user(e) for e in problems],
                                                                                       answers).tolist()
    n = len(scores)
    mean = sum(scores) / n
    var = sum((x - mean) ** 2 for x in scores) / (n - 1) if n > 1 else 0.0
    return {"mean": mean, "se": math.sqrt(var / n), "n": n, "scores": scores}
