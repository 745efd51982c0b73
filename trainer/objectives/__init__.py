"""The objectives of the one train step (trainer/step.py): each supplies `weight(batch)` (its loss
units: target tokens, response tokens, preference pairs, completion tokens) and `loss(model, batch,
device)` (the summed loss of one micro-batch as a TokenLoss). language_modelling.py: pretraining's
next-token prediction. Post-training's keep the step's extra metrics for `pop_metrics()`: sft.py:
response-only cross-entropy; dpo.py: DPO/IPO on chosen/rejected pairs; grpo.py: group-relative
advantages and the clipped policy-gradient loss over rollouts; reward.py: a reward model's Bradley-Terry
loss on the same pairs; ppo.py: PPO's clipped policy and value losses over rollouts scored by a reward
model, with GAE."""

from .dpo import DirectPreference, PairBatch, dpo_loss, sequence_logps
from .grpo import GroupRelativePolicy, RolloutBatch, group_advantages, grpo_token_loss
from .language_modelling import LanguageModelling
from .ppo import PolicyAndValue, PPOBatch, ProximalPolicy
from .reward import BradleyTerry, RewardModel
from .sft import SupervisedFineTuning

__all__ = ["BradleyTerry", "DirectPreference", "RewardModel", "GroupRelativePolicy", "LanguageModelling", "PairBatch", "PolicyAndValue", "PPOBatch", "ProximalPolicy", "RolloutBatch",
           "SupervisedFineTuning", "dpo_loss", "group_advantages", "grpo_token_loss", "sequence_logps"]
