"""Mixed precision as the seed and Megatron hold it (seed: "2 (bf16 weight) + 2 (bf16 gradient) + 4 + 4 + 4
= 16 bytes per parameter"; "Megatron-style frameworks accumulate gradients in fp32, which makes it 18").

`precision: bf16`: the model's parameters, and so its gradients and every activation and collective
that carries them, are bf16; the optimizer keeps an fp32 master of each parameter and fp32 moments,
steps on the masters and copies them back, rounded, into the model. Where those masters live:
- here (`MasterAdamW`, `MasterSGD`) for layouts whose optimizer sees whole (or TP-local) parameters:
  one process, DDP, TP, PP, CP, EP;
- in ZeRO-1's shards (trainer.parallel.zero1: 12/d bytes per rank);
- in FSDP2's sharded fp32 parameters, with a MixedPrecisionPolicy that gathers bf16 (trainer.parallel.fsdp):
  there the model's parameters stay fp32 and only compute is bf16.
Buffers (RoPE frequencies, MoE routing biases) stay fp32: they are not trained by gradients and lose
what bf16 would round away. `precision: fp32` is the reference: fp32 parameters, the plain optimizer.

`precision: fp8` is bf16 in every respect above, and in addition the linear layers' matmuls run in
float8 e4m3 through torchao's float8 training (`convert_to_fp8`: each nn.Linear becomes a Float8Linear
that casts its input, weight and output gradient to float8 with dynamic scales, tensorwise or rowwise,
as TorchTitan's float8 converter does). Its weights are the same bf16 parameters under the same names,
and torchao keeps the bf16 input and weight for the backward, so state, activations, checkpoints and
the estimator's bytes are those of bf16. Only devices with FP8 tensor cores (CUDA capability >= 8.9)
run it: anywhere else it is refused before training starts (`check_fp8_device`).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
LOW_PRECISION = ("bf16", "fp8")  # bf16 parameters, fp32 masters, bf16 autocast
FP8_CAPABILITY = (8, 9)  # Ada and Hopper onwards have FP8 tensor cores (torch._scaled_mm's requirement)


def fp8_device_problem(device: torch.device) -> str | None:
    """Why `device` cannot train in float8 (None when it can)."""
    if device.type != "cuda":
        return f"{device.type} has no FP8 tensor cores (needs CUDA compute capability >= 8.9)"
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_CAPABILITY:
        return (f"{device} ({torch.cuda.get_device_name(device)}) has compute capability {cap[0]}.{cap[1]}; "
                "FP8 tensor cores need >= 8.9 (Ada, Hopper or later)")
    return None


def check_fp8_device(device: torch.device, emulate: bool = False) -> None:
    """Refuse `precision: fp8` on a device without FP8 tensor cores, in one line (fp8.emulate: allowed
    anywhere, for tests: torchao emulates the float8 matmuls, slowly)."""
    problem = None if emulate else fp8_device_problem(device)
    if problem:
        raise RuntimeError(f"pretrain.precision=fp8 refused: {problem}; use precision=bf16 on this device")


def fp8_layer_filter(skip: list[str]):
    """torchao's module_filter_fn: convert a linear layer unless its name is (or ends with) one of `skip`
    or a dimension is not a multiple of 16 (torch._scaled_mm's requirement, which TorchTitan also applies)."""

    def keep_fp8(module: nn.Module, fqn: str) -> bool:
        if any(fqn == name or fqn.endswith("." + name) for name in skip):
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    return keep_fp8


def convert_to_fp8(model: nn.Module, fp8, device: torch.device) -> list[str]:
    """Swap the model's linear layers for torchao's Float8Linear in place (`fp8`: TrainConfig.fp8), after
    checking the device; returns the names of the converted layers. The weights stay the same Parameter
    objects, so this may run on a model still on the meta device, before it is materialised."""
    check_fp8_device(device, fp8.emulate)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name(fp8.recipe)
    if fp8.recipe == "rowwise":  # as TorchTitan sets it: inductor otherwise fuses rowwise casts inexactly (pytorch#150859)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    if fp8.emulate:
        config = dataclasses.replace(config, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_layer_filter(fp8.skip))
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def autocast_for(precision: str, device: torch.device):
    """bf16: matmul inputs in bf16 and the ops autocast keeps in fp32 (softmax, losses) in fp32, whether
    the parameters are bf16 (the model's own) or fp32 (FSDP's masters, a post-training job's)."""
    if precision in LOW_PRECISION:  # fp8: Float8Linear takes its bf16 input from autocast
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"precision={precision!r}; expected fp32, bf16 or fp8")


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The parameters (not the buffers) in `dtype`, in place, before any parallel wrapper sees them."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


class MasterWeights:
    """A torch optimizer that steps fp32 masters of low-precision parameters (Megatron's
    Float16OptimizerWithFloat16Params, as a mixin over AdamW or SGD).

    The masters are made from the parameters at the first step. A step gives each master its
    parameter's gradient in fp32, runs the torch optimizer's own update on the masters (so its state,
    keyed by the model's parameters, holds fp32 moments), and copies each master back into its
    parameter. `state_dict()` carries every master beside its moments ("master"), so a checkpoint
    resumes bit for bit, and `torch.distributed.checkpoint.state_dict` keys it by parameter name like
    the moments (a DTensor under tensor parallel), so it reshards with them."""

    masters: dict[torch.Tensor, torch.Tensor]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeights: closures are not supported")
        if not hasattr(self, "masters"):
            self.masters = {}
        originals = [g["params"] for g in self.param_groups]
        aliases = []
        try:
            for group in self.param_groups:
                swapped = []
                for p in group["params"]:
                    master = self.masters.get(p)
                    if master is None:
                        master = self.masters[p] = p.detach().to(torch.float32).clone()
                    master.grad = None if p.grad is None else p.grad.to(torch.float32)
                    self.state[master] = self.state[p]  # the same dict: torch fills and updates it in place
                    aliases.append(master)
                    swapped.append(master)
                group["params"] = swapped
            super().step()
        finally:
            for group, params in zip(self.param_groups, originals):
                group["params"] = params
            for master in aliases:
                self.state.pop(master, None)
                master.grad = None
        for p, master in self.masters.items():
            p.copy_(master)

    def state_dict(self):
        sd = super().state_dict()
        masters = getattr(self, "masters", {})
        params = [p for g in self.param_groups for p in g["params"]]  # torch numbers them in this order
        for index, p in enumerate(params):
            if p in masters:
                sd["state"].setdefault(index, {})["master"] = masters[p]
        return sd

    def load_state_dict(self, state_dict):
        """torch casts every floating-point state value to its parameter's dtype on load; masters and
        moments are taken back from `state_dict` in fp32, as saved."""
        saved = state_dict["state"]
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        self.masters = {}
        for index, p in zip(ids, params):
            entry = saved.get(index, {})
            for key, value in entry.items():
                if key == "master" or key in MOMENT_KEYS:
                    value = value.detach().to(device=p.device, dtype=torch.float32)
                    value = value.clone() if value is entry[key] else value
                    if key == "master":
                        self.masters[p] = value
                    else:
                        self.state[p][key] = value
            self.state[p].pop("master", None)


class MasterAdamW(MasterWeights, torch.optim.AdamW):
    pass


class MasterSGD(MasterWeights, torch.optim.SGD):
    pass
