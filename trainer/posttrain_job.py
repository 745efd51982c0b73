"""A post-training job (`spec.section` = "posttrain.<sft|dpo|grpo|rm|ppo>"): the same
model, parallel plan, optimizer, schedule and `train_step` as pretraining (seed: post-training "reuses
the same training stack and parallelism"), with the batch source and objective of the sub-step.

Inputs (name -> folder): `base` (model.safetensors with the trainer's names: the model this step
starts from, also the frozen reference), `tokenizer` (with its chat template), `data` (train.jsonl; PPO
also heldout.jsonl), and for PPO `reward` (the reward model's model.safetensors: its critic starts there).
GRPO and PPO build their rollout engine in this process from `posttrain.<step>.engine` ("module:factory",
the serving engine by default); GRPO scores answers with `posttrain.grpo.reward`, PPO with the reward model.
Output: model.safetensors (adapters merged; the reward model's is its trunk and `score.weight`, PPO's the
policy alone), adapter/ (PEFT) when LoRA is on, metrics.jsonl, result.json (written by run_job)."""

from __future__ import annotations

import copy
import importlib
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from infra.config import LifecycleConfig
from infra.launch.base import endpoint_for
from infra.launch.job import JobResult, JobSpec

from . import posttrain_data as pdata
from .activation_stats import ActivationStats
from .job_io import OutputFolder, fetch_input
from .lora import adapter_state_dict, apply_lora, peft_config, save_peft
from .metrics import MetricsSink
from .model import Transformer
from .objectives import (BradleyTerry, DirectPreference, GroupRelativePolicy, PolicyAndValue, ProximalPolicy,
                         RewardModel, SupervisedFineTuning)
from .objectives.grpo import rollout_batches
from .parallel import build_parallel_dims, parallelize
from .parallel.ddp import unwrap
from .parallel.gather import full_state_dict, trained_state_dict
from .parallel.mesh import pick_device
from .parallel.zero1 import build_parallel_optimizer
from .step import train_step

STEPS = ("sft", "dpo", "grpo", "rm", "ppo")
CHECKER = "stages.evaluate.task_family:check"  # PPO's rollout and held-out accuracy (the reward is the model's)


def load_object(ref: str):
    """"module:attribute" -> the attribute (how the job names pluggable pieces such as the rollout engine)."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"{ref!r} is not 'module:attribute'")
    return getattr(importlib.import_module(module), name)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    f = path / "model.safetensors" if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"post-training base weights: {f} does not exist")
    return load_file(str(f))


def stop_token_ids(tok) -> list[int]:
    """End of an answer: EOS, and the chat template's end-of-turn token when the vocabulary has one."""
    ids = {tok.eos_token_id}
    end = tok.convert_tokens_to_ids("<|end|>")
    if isinstance(end, int) and end != tok.unk_token_id:
        ids.add(end)
    return sorted(i for i in ids if i is not None)


class PosttrainJob:
    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.cfg = LifecycleConfig.model_validate(spec.config)
        section, _, step = spec.section.partition(".")
        if section != "posttrain" or step not in STEPS:
            raise ValueError(f"job section {spec.section!r}; expected one of " + ", ".join(f"posttrain.{s}" for s in STEPS))
        self.step_name = step
        self.replay = 0  # SFT's replayed pretraining rows
        self.sc = getattr(self.cfg.posttrain, step)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device, _ = pick_device(self.cfg.parallel.backend, self.cfg.infra.device)
        self.dims = build_parallel_dims(self.cfg.parallel, self.device.type)
        self.dp_group = self.dims.group("dp")
        self.seed = self.sc.seed if self.sc.seed is not None else self.cfg.seed
        ep = endpoint_for(spec)
        for name in ("base", "tokenizer", "data"):
            if name not in spec.inputs:
                raise ValueError(f"job {spec.job_id}: inputs has no {name!r} entry (got {sorted(spec.inputs)})")
        self.base_dir = fetch_input(spec.inputs["base"], spec.workdir, "base", ep)
        self.tokenizer_dir = fetch_input(spec.inputs["tokenizer"], spec.workdir, "tokenizer", ep)
        data_dir = fetch_input(spec.inputs["data"], spec.workdir, "data", ep)
        self.tok = pdata.load_tokenizer(self.tokenizer_dir)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        torch.manual_seed(self.seed)
        base = Transformer(self.cfg.model).to(self.device)
        base.load_state_dict(load_weights(self.base_dir))
        needs_ref = step in ("dpo", "grpo", "ppo")
        self.reference = copy.deepcopy(base).eval().requires_grad_(False) if needs_ref else None
        lora = self.sc.lora
        if lora.enabled:
            apply_lora(base, lora.r, lora.alpha, lora.dropout, lora.target_modules)
        trained: torch.nn.Module = base
        if step == "rm":  # the head's initial values come from the job's seed: the same on every rank
            trained = RewardModel(base, self.cfg.model.dim).to(self.device)
        elif step == "ppo":  # the actor and the critic (the reward model as it was trained), one module
            if "reward" not in spec.inputs:
                raise ValueError(f"job {spec.job_id}: PPO needs a 'reward' input (the reward model's weights)")
            reward_dir = fetch_input(spec.inputs["reward"], spec.workdir, "reward", ep)
            critic = self.reward_model(load_weights(reward_dir))
            self.reward_scorer_model = self.reward_model(load_weights(reward_dir)).eval().requires_grad_(False)
            trained = PolicyAndValue(base, critic)
        self.model = parallelize(trained, self.dims, self.cfg.parallel, self.sc)
        self.activations = ActivationStats(unwrap(self.model), self.cfg.model.n_layers, self.device) \
            if self.sc.activation_stats else None
        # ZeRO-1 is the optimizer (parallel/zero1.py); otherwise the plain one, as pretraining builds it
        self.optimizer = build_parallel_optimizer(unwrap(self.model), self.dims, self.cfg.parallel, self.sc)
        self.output = OutputFolder(spec.output, spec.workdir, ep, writer=self.rank == 0)
        rows = pdata.read_jsonl(data_dir / "train.jsonl")
        dp = dict(dp_rank=self.dims.rank("dp"), dp_size=self.dims.dp, seed=self.seed)
        s = self.sc
        if step == "sft":
            examples = [pdata.encode_example(self.tok, r) for r in rows]
            packed = pdata.pack(examples, s.seq_len, self.pad_id, packed=s.pack)
            self.replay = pdata.replay_count(len(packed), s.replay_fraction)
            if self.replay:
                if "replay" not in spec.inputs:
                    raise ValueError(f"job {spec.job_id}: sft.replay_fraction={s.replay_fraction} needs a 'replay' "
                                     "input (the packed pretraining split)")
                replay_dir = fetch_input(spec.inputs["replay"], spec.workdir, "replay", ep)
                packed = packed + pdata.replay_rows(replay_dir, self.replay, s.seq_len, self.seed)
            self.objective = SupervisedFineTuning()
            self.loader = pdata.ItemLoader(packed, global_batch_size=s.global_batch_size,
                                           micro_batch_size=s.micro_batch_size,
                                           collate=lambda ids: pdata.lm_batch(packed, ids), **dp)
        elif step in ("dpo", "rm"):
            pairs = [pdata.encode_pair(self.tok, r) for r in rows]
            self.objective = BradleyTerry(center_rewards=s.center_rewards) if step == "rm" else \
                DirectPreference(beta=s.beta, kind=s.loss, rpo_alpha=s.rpo_alpha, reference=self.reference)
            self.loader = pdata.ItemLoader(pairs, global_batch_size=s.global_batch_size,
                                           micro_batch_size=s.micro_batch_size,
                                           collate=lambda ids: pdata.pair_batch(pairs, ids, self.pad_id), **dp)
        elif step == "ppo":
            self._init_ppo(rows, data_dir, dp)
        else:
            for n, r in enumerate(rows, 1):
                if "answer" not in r:
                    raise ValueError(f"GRPO data row {n} has no `answer` (keys {sorted(r)})")
            self.prompts = [(pdata.prompt_ids(self.tok, r), str(r["answer"])) for r in rows]
            self.objective = GroupRelativePolicy(epsilon=s.epsilon, epsilon_high=s.epsilon_high, beta=s.beta,
                                                 reference=self.reference, temperature=s.temperature,
                                                 loss_type=s.loss_type, max_new_tokens=s.max_new_tokens,
                                                 kl_ratio_correction=s.kl_ratio_correction)
            per_rank = s.prompts_per_step // self.dims.dp
            if per_rank * self.dims.dp != s.prompts_per_step:
                raise ValueError(f"grpo.prompts_per_step={s.prompts_per_step} does not split over dp={self.dims.dp}")
            self.loader = pdata.ItemLoader(self.prompts, global_batch_size=s.prompts_per_step,
                                           micro_batch_size=per_rank, collate=lambda ids: ids, **dp)
            self.reward = load_object(s.reward)
            factory = load_object(s.engine)
            self.engine = factory(model_cfg=self.cfg.model, state_dict=self.current_weights(),
                                  tokenizer_dir=self.tokenizer_dir, workdir=Path(spec.workdir) / "engine",
                                  stop_token_ids=stop_token_ids(self.tok), device=self.device.type)
        self.step = 0

    def reward_model(self, sd: dict[str, torch.Tensor]) -> RewardModel:
        """A RewardModel (a fresh trunk of this config and its head) holding the reward model's weights."""
        model = RewardModel(Transformer(self.cfg.model), self.cfg.model.dim)
        model.load_state_dict(sd)
        return model.to(self.device)

    def _init_ppo(self, rows: list[dict], data_dir: Path, dp: dict) -> None:
        from .posttrain_ppo import PPOBatches, RewardScorer

        s = self.sc
        for n, r in enumerate(rows, 1):
            if "answer" not in r:
                raise ValueError(f"PPO data row {n} has no `answer` (the checker's; the reward is the model's)")
        self.prompts = [(pdata.prompt_ids(self.tok, r), str(r["answer"])) for r in rows]
        if s.prompts_per_step % self.dims.dp:
            raise ValueError(f"ppo.prompts_per_step={s.prompts_per_step} does not split over dp={self.dims.dp}")
        per_rank = s.prompts_per_step // self.dims.dp
        if (per_rank * s.samples_per_prompt) % s.minibatches:
            raise ValueError(f"ppo: {per_rank * s.samples_per_prompt} rollouts per rank do not cut into "
                             f"{s.minibatches} minibatches")
        self.loader = pdata.ItemLoader(self.prompts, global_batch_size=s.prompts_per_step, micro_batch_size=per_rank,
                                       collate=lambda ids: ids, **dp)
        self.objective = ProximalPolicy(cliprange=s.cliprange, cliprange_value=s.cliprange_value, vf_coef=s.vf_coef,
                                        temperature=s.temperature)
        self.stop_ids = stop_token_ids(self.tok)
        heldout_file = data_dir / "heldout.jsonl"
        heldout = pdata.read_jsonl(heldout_file) if heldout_file.is_file() else []
        self.engine = load_object(s.engine)(model_cfg=self.cfg.model, state_dict=self.policy_weights(),
                                            tokenizer_dir=self.tokenizer_dir, workdir=Path(self.spec.workdir) / "engine",
                                            stop_token_ids=self.stop_ids, device=self.device.type)
        scorer = RewardScorer(self.reward_scorer_model, self.tok, self.pad_id, self.device)
        self.ppo = PPOBatches(self, self.reference, scorer, rows, load_object(CHECKER), heldout)

    @property
    def optimizer_steps(self) -> int:
        """PPO's `steps` are rollout batches, each ppo_epochs x minibatches optimizer steps."""
        s = self.sc
        return s.steps * s.ppo_epochs * s.minibatches if self.step_name == "ppo" else s.steps

    def policy_weights(self, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The language model's weights (trainer names): all of them, or PPO's actor without its critic."""
        weights = self.current_weights() if weights is None else weights
        if self.step_name != "ppo":
            return weights
        return {k.removeprefix("policy."): v for k, v in weights.items() if k.startswith("policy.")}

    def push_weights(self) -> None:
        """The policy's new weights into the rollout engine (which also resets its prefix cache): with LoRA and
        an engine that serves adapters, the adapter alone (its base weights are the step's starting model's,
        which LoRA never changes); else the weights a step changed, or all of them."""
        model = unwrap(self.model)
        policy = model.policy if self.step_name == "ppo" else model
        sharded = any(getattr(p, "placements", None) is not None for p in model.parameters())  # FSDP: gather instead
        if self.sc.lora.enabled and getattr(self.engine, "serves_adapters", False) and not sharded:
            self.engine.load_adapter((peft_config(policy), adapter_state_dict(policy)))
            return
        self.engine.update_weights(self.policy_weights(self.weights_to_push()))

    def current_weights(self) -> dict[str, torch.Tensor]:
        """Every weight, whole, on the CPU (adapters merged). Collective under FSDP and tensor parallel: every
        rank calls it (parallel/gather.py)."""
        return full_state_dict(self.model)

    def weights_to_push(self) -> dict[str, torch.Tensor]:
        """What the rollout engine needs after a step: only what a step can change when the engine copies
        weights in place (the trainable parameters; with LoRA, the adapted layers' merged weights), else
        every weight; whole, on the CPU, gathered on every rank (parallel/gather.py)."""
        if not getattr(self.engine, "copies_in_place", False):
            return self.current_weights()
        return trained_state_dict(self.model)

    # -- GRPO: rollouts ------------------------------------------------------------------------------
    def _generate(self, ids) -> tuple[list, list[list[float]], float]:
        s = self.sc
        t0 = time.perf_counter()
        groups = self.engine.generate([self.prompts[i][0] for i in ids], s.group_size, s.max_new_tokens,
                                      s.temperature, seed=self.seed * 100003 + int(ids[0]) * 7919 + self.step)
        rewards = [[float(self.reward(r.text, self.prompts[i][1])) for r in g] for i, g in zip(ids, groups)]
        return groups, rewards, time.perf_counter() - t0

    def _grpo_steps(self):
        """Yields (micro-batches, metrics) per step; rollouts one step stale when async_rollouts."""
        s = self.sc
        pool = ThreadPoolExecutor(1) if s.async_rollouts else None
        pending = None
        push_s = 0.0
        try:
            while True:
                if pending is None:
                    groups, rewards, gen_s = self._generate(self.loader.next_step()[0])
                else:
                    groups, rewards, gen_s = pending.result()
                if pool is not None:  # the next step's rollouts run on this step's weights, during training
                    pending = pool.submit(self._generate, self.loader.next_step()[0])
                micro, _ = rollout_batches(groups, rewards, max(1, s.micro_batch_size), self.pad_id)
                flat = [x for g in rewards for x in g]
                lengths = [len(r.completion_ids) for g in groups for r in g]
                yield micro, {"reward_mean": sum(flat) / len(flat), "accuracy": sum(x >= 1.0 for x in flat) / len(flat),
                              "response_length": sum(lengths) / len(lengths), "rollout_s": gen_s,
                              "weight_push_s": push_s,
                              "groups_all_same": sum(len(set(g)) == 1 for g in rewards) / len(rewards)}
                if pending is not None:
                    pending.result()  # the engine must be idle before its weights change
                t0 = time.perf_counter()
                self.push_weights()
                push_s = time.perf_counter() - t0
        finally:
            if pool is not None:
                pool.shutdown(wait=True)

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> JobResult:
        s = self.sc
        n_steps = self.optimizer_steps
        train_cfg = s if n_steps == s.steps else s.model_copy(update={"steps": n_steps})  # the lr schedule's length
        sink = MetricsSink(self.output.path, self.spec.tracking.uri, self.spec.tracking.run_id,
                           total_steps=n_steps, enabled=self.rank == 0, sync=self.output.sync,
                           system_metrics_s=self.cfg.infra.system_metrics_s)
        trainable = sum(p.numel() for p in unwrap(self.model).parameters() if p.requires_grad)
        total = sum(p.numel() for p in unwrap(self.model).parameters())
        sink.log_params({"posttrain_step": self.step_name, "trainable_params": trainable, "total_params": total,
                        "replay_rows": self.replay})
        rollouts = self.step_name in ("grpo", "ppo")
        batches = self._grpo_steps() if self.step_name == "grpo" else iter(self.ppo) if self.step_name == "ppo" \
            else iter(self.loader)
        last: dict[str, float] = {}
        status, message = "completed", ""
        try:
            while self.step < n_steps:
                t0 = time.perf_counter()
                item = next(batches)
                micro, extra = item if rollouts else (item, {})
                logged = (self.step + 1) % s.log_every == 0 or self.step + 1 == n_steps
                if logged and self.activations is not None:
                    self.activations.start()
                t1 = time.perf_counter()
                res = train_step(self.model, self.optimizer, micro, self.objective, train_cfg, self.step, self.device,
                                 self.dp_group)
                train_s = time.perf_counter() - t1
                acts = self.activations.finish() if logged and self.activations is not None else {}
                self.step += 1
                last = {"loss": res.loss, "grad_norm": res.grad_norm, "lr": res.lr, "train_s": train_s,
                        "data_s": t1 - t0, **self.objective.pop_metrics(), **extra}
                if not math.isfinite(res.loss):
                    status, message = "diverged", f"loss is {res.loss} at step {self.step}"
                    break
                if logged:
                    sink.log({**last, **acts}, self.step)
                sink.advance()
        finally:
            sink.close()
            if hasattr(batches, "close"):
                batches.close()
        if status == "completed":
            self.save()
        return JobResult(status=status, steps=self.step, metrics={k: float(v) for k, v in last.items()},
                         message=message)

    def save(self) -> None:
        """Every rank gathers the weights (collective under FSDP and tensor parallel); rank 0 writes them."""
        from safetensors.torch import save_file

        weights = self.policy_weights()
        if self.rank != 0:
            return
        out = self.output.path
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt", "posttrain_step": self.step_name})
        model = unwrap(self.model)
        if self.sc.lora.enabled and self.step_name != "rm":  # the reward model ships merged only
            save_peft(model.policy if self.step_name == "ppo" else model, out / "adapter")
        print(f"posttrain.{self.step_name}: saved {out / 'model.safetensors'}", file=sys.stderr)


def run_posttrain(spec: JobSpec) -> JobResult:
    return PosttrainJob(spec).run()
