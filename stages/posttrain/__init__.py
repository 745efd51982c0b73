"""The post-train stage (seed chapter "Post-training"): SFT -> DPO -> GRPO as three registry steps,
`posttrain-sft`, `posttrain-dpo`, `posttrain-grpo`, each an artifact that reads the previous one, each
a job of the built-in trainer with its objective (trainer/objectives/). data.py writes the built-in
data from the verifiable task family's train split; rollout.py puts the serving engine behind GRPO's
rollout interface; accuracy.py scores held-out accuracy and preference accuracy; stage.py runs the
steps."""
