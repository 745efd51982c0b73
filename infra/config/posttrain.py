"""`posttrain:` the seed's post-training chapter as sub-steps from one SFT model, in two branches (`chain`):
SFT -> DPO -> GRPO, and classic RLHF, SFT -> reward model -> PPO. Each step has its own training settings
(a TrainConfig with post-training defaults), optional LoRA, and the verifiable task whose held-out accuracy
is reported before and after every step.

The tiny defaults are sized so the three steps take a few minutes on 2 CPU cores."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section
from .train import TrainConfig


class LoRAConfig(Section):
    """Low-rank adapters (Hu et al. 2021): W x + (alpha / r) * B A x, with A [r, in] and B [out, r]."""

    enabled: bool = False
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / r) * B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="linear layers (by their last name) that get adapters: q_proj k_proj v_proj o_proj "
                    "gate_proj up_proj down_proj",
    )

    @model_validator(mode="after")
    def _targets(self) -> "LoRAConfig":
        known = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        bad = sorted(set(self.target_modules) - known)
        if bad or not self.target_modules:
            raise ValueError(f"lora.target_modules={self.target_modules}: unknown {bad}; allowed {sorted(known)}")
        return self


class TaskConfig(Section):
    """The verifiable task (stages/evaluate/task_family.py's arithmetic prompts, split and checker) at a
    difficulty a tiny model can move on: a OP b with operands 0..max_operand."""

    max_operand: int = Field(14, ge=1, le=9999, description="operands are drawn from 0..max_operand")
    ops: str = Field("+", pattern=r"^[+\-*]+$", description="operators to draw from (+, -, *)")
    heldout_size: int = Field(64, ge=1, description="held-out problems scored before/after every step")
    max_new_tokens: int = Field(6, ge=1, description="generation budget of an answer")


class PosttrainStepConfig(TrainConfig):
    """Training settings of one sub-step (TrainConfig with post-training defaults) plus its data."""

    enabled: bool = True
    steps: int = Field(60, ge=1, description="optimizer steps")
    seq_len: int = Field(64, ge=8, description="tokens per packed row")
    micro_batch_size: int = Field(16, ge=1)
    global_batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(5, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    data: str | None = Field(None, description="user jsonl (same shapes as the built-in data); None = built in")
    num_examples: int = Field(2000, ge=1, description="built-in examples drawn from the task's train split")
    lora: LoRAConfig = Field(default_factory=LoRAConfig)


class SFTConfig(PosttrainStepConfig):
    """Supervised fine-tuning: loss only on the assistant's tokens (seed: "The loss is computed only on
    response tokens"). Rows are `messages` lists (rendered by the tokenizer's chat template) or
    prompt/completion pairs."""

    steps: int = Field(150, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(10, ge=0)
    num_examples: int = Field(4000, ge=1)
    pack: bool = Field(True, description="pack several conversations per row (the loss mask survives)")
    replay_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of the training rows that are pretraining text (windows of the tokens "
        "artifact's train split, loss on every token), mixed into every batch so the model stays the language "
        "model it was (InstructGPT's pretraining mix); 0 = none")


class DPOConfig(PosttrainStepConfig):
    """Direct Preference Optimization (Rafailov et al. 2023) on chosen/rejected pairs against a frozen
    reference (the model the step starts from)."""

    steps: int = Field(60, ge=1)
    lr: float = Field(1e-4, gt=0)
    micro_batch_size: int = Field(8, ge=1)
    global_batch_size: int = Field(16, ge=1)
    beta: float = Field(0.1, gt=0, description="strength of the implicit KL to the reference")
    loss: Literal["sigmoid", "ipo"] = Field("sigmoid", description="sigmoid (DPO) or ipo (Azar et al. 2023)")
    rpo_alpha: float | None = Field(None, ge=0, description="adds rpo_alpha x each chosen answer's mean per-token "
                                    "NLL (RPO, Pang et al. 2024): DPO alone lowers both answers' likelihoods as it "
                                    "separates them. TRL's loss_type 'sft' term averages all chosen tokens of the "
                                    "batch instead, which weighs long answers more")
    preference_pairs: int | None = Field(None, ge=1, description="held-out pairs (each held-out problem against its "
                                         "6 near misses, off by 1-3) on which preference accuracy is measured; "
                                         "None = all of them")


class GRPOConfig(PosttrainStepConfig):
    """Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) with a verifiable reward."""

    steps: int = Field(30, ge=1)
    lr: float = Field(2e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = "constant"
    prompts_per_step: int = Field(16, ge=1, description="prompts whose groups make one optimizer step")
    group_size: int = Field(8, ge=2, description="G: samples per prompt")
    micro_batch_size: int = Field(64, ge=1, description="completions per micro-batch")
    global_batch_size: int = Field(128, ge=1, description="completions per step (prompts_per_step * group_size)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the rollouts; every log-prob of the "
                               "loss (policy, reference, the engine's behaviour log-probs) is of softmax(logits / T), "
                               "as TRL's")
    max_new_tokens: int = Field(6, ge=1)
    epsilon: float = Field(0.2, gt=0, description="clip range below 1 (and above, unless epsilon_high)")
    epsilon_high: float | None = Field(None, gt=0, description="clip range above 1 (DAPO's clip-higher)")
    beta: float = Field(0.0, ge=0, description="KL(policy || reference) coefficient (k3 estimator). 0 by default, "
                        "as TRL's: DAPO and Dr. GRPO found the KL term unneeded with verifiable rewards, and without "
                        "it no reference forward runs (the KL is still logged); DeepSeek-R1 used 0.001")
    kl_ratio_correction: bool = Field(True, description="multiply the KL term by the importance ratio, which makes "
                                      "its gradient the unbiased reverse-KL one (DeepSeek-V3.2; TRL's "
                                      "use_bias_correction_kl, on by default there too)")
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = Field(
        "dapo", description="how token losses make the step's loss, as TRL's loss_type: dapo (default, as TRL's) "
        "averages over every completion token of the step; grpo averages each answer's tokens, then the answers "
        "(the paper's, biased towards short right and long wrong answers); dr_grpo sums and divides by answers * "
        "max_new_tokens (Dr. GRPO)")
    async_rollouts: bool = Field(False, description="generate step t+1's rollouts with the weights of step t-1 "
                                                    "while step t trains (one-step-stale, seed: asynchronous RL)")
    engine: str = Field("stages.posttrain.rollout:ServingEngineRollouts",
                        description="module:factory of the rollout engine the trainer process builds")
    reward: str = Field("stages.evaluate.task_family:check", description="module:function(answer, expected) -> "
                        "bool or float in [0, 1] (1.0 = right; `accuracy` counts those): the exact checker, or "
                        "stages.posttrain.reward:closeness (partial credit for near misses)")

    @model_validator(mode="after")
    def _groups(self) -> "GRPOConfig":
        if self.global_batch_size != self.prompts_per_step * self.group_size:
            raise ValueError(f"grpo.global_batch_size={self.global_batch_size} must equal prompts_per_step * "
                             f"group_size = {self.prompts_per_step} * {self.group_size}")
        return self


class RewardModelConfig(PosttrainStepConfig):
    """The reward model of classic RLHF: the SFT model's trunk with a scalar head, trained with the
    Bradley-Terry loss on the preference pairs DPO uses (chosen = right, rejected = a near miss)."""

    steps: int = Field(60, ge=1)
    lr: float = Field(3e-4, gt=0)
    micro_batch_size: int = Field(8, ge=1)
    global_batch_size: int = Field(16, ge=1)
    center_rewards: float | None = Field(None, ge=0, description="adds c * (r_chosen + r_rejected)^2 so rewards "
                                         "centre on 0 (TRL's center_rewards_coefficient; Eisenstein et al. 2023 "
                                         "used 0.01)")
    preference_pairs: int | None = Field(None, ge=1, description="held-out pairs (each held-out problem against its "
                                         "6 near misses) on which pairwise accuracy is measured; None = all")
    min_accuracy_z: float | None = Field(None, description="the stage fails unless held-out pairwise accuracy is more "
                                         "than this many binomial standard errors above chance (0.5); None = reported")


class PPOConfig(PosttrainStepConfig):
    """PPO against the reward model (Ouyang et al. 2022, as TRL's PPOTrainer): actor from SFT, critic from the
    reward model, rollouts from the serving engine, per-token reward -kl_coef * (log pi - log pi_sft) with the
    reward model's score on the last token, GAE, whitened advantages, clipped policy and value losses,
    `ppo_epochs` passes of `minibatches` optimizer steps over each batch of rollouts."""

    steps: int = Field(20, ge=1, description="rollout batches; each makes ppo_epochs * minibatches optimizer steps")
    lr: float = Field(3e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "wsd", "constant"] = "constant"
    beta2: float = Field(0.999, gt=0, lt=1)
    prompts_per_step: int = Field(32, ge=1, description="prompts sampled per rollout batch")
    samples_per_prompt: int = Field(2, ge=1, description="completions per prompt")
    micro_batch_size: int = Field(32, ge=1, description="completions per micro-batch")
    global_batch_size: int = Field(32, ge=1, description="completions per optimizer step (one minibatch): "
                                   "prompts_per_step * samples_per_prompt / minibatches")
    minibatches: int = Field(2, ge=1, description="optimizer steps per pass over a rollout batch")
    ppo_epochs: int = Field(2, ge=1, description="passes over each rollout batch (TRL's num_ppo_epochs)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature; every log-prob is of softmax(logits / T)")
    max_new_tokens: int = Field(6, ge=1)
    cliprange: float = Field(0.2, gt=0, description="policy ratio clip")
    cliprange_value: float = Field(0.2, gt=0, description="value prediction clip around the rollout's values")
    vf_coef: float = Field(0.1, ge=0, description="weight of the value loss (TRL's default)")
    gamma: float = Field(1.0, gt=0, le=1, description="discount")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")
    kl_coef: float = Field(0.05, ge=0, description="initial coefficient of the per-token KL penalty to the SFT model")
    target_kl: float | None = Field(None, gt=0, description="adaptive KL (Ziegler et al. 2019): the coefficient moves "
                                    "so the per-sequence KL tracks this target over kl_horizon samples; None = fixed")
    kl_horizon: int = Field(10000, ge=1, description="samples over which the adaptive coefficient moves")
    whiten_rewards: bool = Field(False, description="whiten the per-token rewards before GAE (TRL's whiten_rewards)")
    missing_eos_penalty: float | None = Field(None, description="subtracted from the score of a completion that never "
                                              "ends its turn (TRL's missing_eos_penalty)")
    heldout_every: int = Field(5, ge=0, description="score greedy answers to the held-out prompts (the task's "
                               "checker and the reward model) every N rollout batches (the stage scores the final model); 0 = never")
    engine: str = Field("stages.posttrain.rollout:ServingEngineRollouts",
                        description="module:factory of the rollout engine the trainer process builds")

    @model_validator(mode="after")
    def _batches(self) -> "PPOConfig":
        total = self.prompts_per_step * self.samples_per_prompt
        if total != self.global_batch_size * self.minibatches:
            raise ValueError(f"ppo: prompts_per_step * samples_per_prompt = {total} must equal global_batch_size * "
                             f"minibatches = {self.global_batch_size} * {self.minibatches}")
        return self


CHAINS = {"dpo-grpo": ("sft", "dpo", "grpo"), "rm-ppo": ("sft", "rm", "ppo"), "both": ("sft", "dpo", "grpo", "rm", "ppo")}


class PosttrainConfig(Section):
    chain: Literal["dpo-grpo", "rm-ppo", "both"] = Field(
        "dpo-grpo", description="which post-training steps run from the SFT model: dpo-grpo (SFT -> DPO -> GRPO), "
        "rm-ppo (classic RLHF: SFT -> reward model -> PPO) or both branches; export ships the last model of each")
    task: TaskConfig = Field(default_factory=TaskConfig)
    heldout_ppl_rows: int = Field(16, ge=1, description="held-out pretraining rows (the tokens artifact's val split) "
                                  "whose perplexity every step reports before and after")
    max_heldout_ppl_ratio: float | None = Field(
        None, ge=1.0, description="a step fails when its model's held-out pretraining perplexity exceeds this many "
        "times the pretrained model's (seed: post-training \"uses a small fraction of pretraining compute\": it "
        "should not unlearn the language model); None = reported, not enforced")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    rm: RewardModelConfig = Field(default_factory=RewardModelConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)

    @property
    def steps(self) -> tuple[str, ...]:
        """The steps the chain runs, in order."""
        return CHAINS[self.chain]
