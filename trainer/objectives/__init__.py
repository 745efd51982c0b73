"""Post-training objectives for the one training loop (trainer/loop.py): each supplies `weight(batch)`
(its loss units: response tokens, preference pairs, completion tokens) and `loss(model, batch, device)`
(the summed loss of one micro-batch as a TokenLoss), and keeps the step's extra metrics for
`pop_metrics()`. sft.py: response-only cross-entropy; dpo.py: DPO/IPO on chosen/rejected pairs;
grpo.py: group-relative advantages and the clipped policy-gradient loss over rollouts."""

from .dpo import DirectPreference, PairBatch, dpo_loss, sequence_logps
from .grpo import GroupRelativePolicy, RolloutBatch, group_advantages, grpo_token_loss
from .sft import SupervisedFineTuning

__all__ = ["DirectPreference", "GroupRelativePolicy", "PairBatch", "RolloutBatch", "SupervisedFineTuning",
           "dpo_loss", "group_advantages", "grpo_token_loss", "sequence_logps"]
