"""GRPO's rollout engine: the serving engine (stages/serve/engine.py) in the trainer's process behind
trainer/objectives/grpo.py's `RolloutEngine` interface (seed: "a fleet of inference engines ...
generating rollouts. After each update the new weights are broadcast to the engines"). The engine
loads the Hugging Face layout, so the starting weights are written once with stages/export/hf.py and
every update is pushed as the same name mapping, which also resets its prefix cache. With LoRA the base
weights never change: the trainer's adapter (PEFT's config and tensors, in memory) is loaded as the engine's
LoRA adapter (`load_adapter`, vLLM's load_inplace) and every request runs with it, so a sync moves the
factors alone."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from infra.config.model import ModelConfig
from stages.export import hf as hf_layout
from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams
from trainer.objectives.grpo import Rollout


class ServingEngineRollouts:
    def __init__(self, *, model_cfg: ModelConfig, state_dict: dict[str, torch.Tensor], tokenizer_dir: Path,
                 workdir: Path, stop_token_ids: list[int], device: str = "cpu", kv_cache_memory_gb: float = 0.05):
        self.cfg, self.stop_token_ids = model_cfg, list(stop_token_ids)
        self.arch = hf_layout.hf_architecture(model_cfg)
        hf_dir = Path(workdir) / "hf"
        hf_layout.write_hf(state_dict, model_cfg, hf_dir, dtype="float32", tokenizer_dir=tokenizer_dir)
        # the behaviour log-probs GRPO's ratio needs: of the distribution sampled from (temperature applied)
        self.engine = LLMEngine(hf_dir, EngineConfig(device=device, dtype="float32", kv_cache_memory_gb=kv_cache_memory_gb,
                                                     max_num_seqs=256, max_num_batched_tokens=2048,
                                                     logprobs_mode="processed_logprobs"))
        self.pushes = 0
        self.lora_name: str | None = None  # the trainer's adapter, once one is loaded

    def generate(self, prompts: Sequence[list[int]], samples: int, max_new_tokens: int, temperature: float,
                 seed: int) -> list[list[Rollout]]:
        flat = [list(p) for p in prompts for _ in range(samples)]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + i, logprobs=0,
                                 stop_token_ids=self.stop_token_ids) for i in range(len(flat))]
        outs = self.engine.generate(flat, params, lora_name=self.lora_name)
        rollouts = [Rollout(prompt_ids=p, completion_ids=list(o.token_ids), logprobs=[lp.logprob for lp in o.logprobs],
                            text=o.text) for p, o in zip(flat, outs)]
        return [rollouts[i:i + samples] for i in range(0, len(rollouts), samples)]

    @property
    def copies_in_place(self) -> bool:
        """update_weights may then be given only the tensors that changed (LLMEngine.update_weights)."""
        return self.engine.model.weight_views() is not None

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.engine.update_weights(hf_layout.to_hf_state_dict(state_dict, self.cfg, self.arch, torch.float32))
        self.pushes += 1

    serves_adapters = True  # load_adapter: a LoRA trainer pushes its adapter alone

    def load_adapter(self, adapter: Path | tuple[dict, dict[str, torch.Tensor]]) -> None:
        """The trainer's PEFT adapter (a folder, or its config and tensors in memory) as the adapter every later
        request runs with; the engine salts its prefix cache per load, so no old entry is reused."""
        self.engine.load_lora("policy", adapter, replace=self.lora_name is not None)
        self.lora_name = "policy"
        self.pushes += 1

    def greedy(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[str]:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, stop_token_ids=self.stop_token_ids)
        return [o.text for o in self.engine.generate([list(p) for p in prompts], params, lora_name=self.lora_name)]
