"""Per-layer activation statistics (seed, on loss spikes: "Watch the loss, the gradient norm and
per-layer activation statistics"): the RMS and the largest |value| of the residual stream leaving
each transformer block, over one step's micro-batches, for the whole global batch.

A residual stream whose RMS grows with depth or with steps, and single features far above the rest
(absmax / RMS in the hundreds), come before the loss spikes that QK-norm and z-loss are there to
prevent, and they are what FP8 and INT8 quantization trip over.

Forward hooks on the blocks (the model knows nothing of this) add to per-layer sums only while a
step is being recorded. Each rank sees a part: under data parallelism its own rows, under tensor
(with sequence) and context parallelism a shard of each activation or a replica of it, under
pipeline parallelism the layers of its stage. One all-reduce of the sums (and one of the maxima)
over every rank gives every rank the figures of the whole batch, the same as one process's: a
replica adds its squares and its count alike, so the mean is unchanged. A block run again by
activation checkpointing's recomputation counts twice in the same way, with the same values.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def _blocks(model: nn.Module) -> dict[int, nn.Module]:
    """The transformer blocks this rank holds, by global layer index: every module named
    `layers.<i>` (the Transformer's ModuleDict, whatever wraps the model or the blocks)."""
    found = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit():
            found.setdefault(int(parts[-1]), module)  # the outermost (a checkpoint or FSDP wrapper)
    return found


class ActivationStats:
    def __init__(self, model: nn.Module | list[nn.Module], n_layers: int, device: torch.device):
        self.n_layers = n_layers
        self.recording = False
        # per layer: sum of squares and element count (float64: counts of 1e9+ stay exact), and |max|
        self._sums = torch.zeros(n_layers, 2, dtype=torch.float64, device=device)
        self._max = torch.zeros(n_layers, device=device)
        self._handles = []
        for part in model if isinstance(model, list) else [model]:
            for i, block in _blocks(part).items():
                self._handles.append(block.register_forward_hook(self._hook(i)))
        if not self._handles:
            raise ValueError("no transformer blocks found (modules named layers.<i>) to record activations of")

    def _hook(self, layer: int):
        @torch.compiler.disable  # the statistics stay out of compiled blocks' graphs
        def hook(_module, _args, out):
            if not self.recording:
                return
            x = out.to_local() if hasattr(out, "to_local") else out  # a DTensor: this rank's shard
            x = x.detach()
            self._sums[layer, 0] += x.float().pow(2).sum().double()
            self._sums[layer, 1] += x.numel()
            self._max[layer] = torch.maximum(self._max[layer], x.abs().max().float())
        return hook

    def start(self) -> None:
        """Record the blocks' outputs from now until `finish`."""
        self._sums.zero_()
        self._max.zero_()
        self.recording = True

    @torch.no_grad()
    def finish(self) -> dict[str, float]:
        """Stop recording; every rank calls this (a collective when distributed) and gets
        {"act_rms/layer_07": ..., "act_absmax/layer_07": ...} for the layers seen anywhere."""
        self.recording = False
        sums, top = self._sums.clone(), self._max.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
        out = {}
        for i in range(self.n_layers):
            sq, n = sums[i].tolist()
            if n > 0:
                out[f"act_rms/layer_{i:02d}"] = math.sqrt(sq / n)
                out[f"act_absmax/layer_{i:02d}"] = float(top[i])
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
