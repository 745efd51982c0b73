"""What post-training costs the language model: perplexity on held-out pretraining text (the tokens
artifact's val split, which no step trains on), measured on the same rows before and after every step
and against the pretrained model, so the chain's cost is read off one number per step."""

from __future__ import annotations

from pathlib import Path

import torch

from infra.config.model import ModelConfig


class LanguageModelLost(RuntimeError):
    """A step's held-out pretraining perplexity rose past posttrain.max_heldout_ppl_ratio."""


def heldout_rows(tokens_dir: Path, n: int) -> torch.Tensor:
    """The first n rows of the val split (the export stage's check starts from the same rows)."""
    from trainer.shards import PackedShards

    shards = PackedShards(Path(tokens_dir) / "val")
    if len(shards) == 0:
        raise ValueError(f"{tokens_dir}/val holds no rows: no held-out text to measure perplexity on")
    return torch.from_numpy(shards.rows(range(min(n, len(shards))))).long()


@torch.no_grad()
def heldout_perplexity(sd: dict[str, torch.Tensor], model_cfg: ModelConfig, rows: torch.Tensor) -> float:
    from stages.export.validate import logits_of, our_forward, perplexity_from_logits

    return perplexity_from_logits(logits_of(our_forward(sd, model_cfg), rows), rows)


def pretrained_perplexity(upstream: Path, before: float) -> float:
    """The pretrained model's perplexity: carried in the upstream step's posttrain.json, or `before` when
    the upstream is the pretrained model itself."""
    import json

    summary = Path(upstream) / "posttrain.json"
    if summary.is_file():
        return float(json.loads(summary.read_text()).get("heldout_ppl_pretrained", before))
    return before
