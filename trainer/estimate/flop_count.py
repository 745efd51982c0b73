"""Count the FLOPs a real model spends on one micro-batch's forward and backward, with torch's FLOP
counter, so the trainer can log its measured FLOPs next to the estimate.

Two corrections to torch's default table keep the count in the estimate's (and MFU's) convention of
*model* FLOPs: torch does not count the CPU FlashAttention kernel at all (its forward is added: the two
s x s matmuls, like the GPU kernels), and it counts a fused attention backward as five matmuls because
the kernel recomputes the scores; recomputation is hardware work, not model work (PaLM's MFU excludes
it), so the backward is counted as the four matmuls of its gradients, twice the forward. Like torch, the
count covers the whole s x s score matrix, ignoring the causal mask (`attention_flops: full`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

aten = torch.ops.aten


def _sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    # dS = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q: four matmuls the size of the forward's two.
    return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_mapping() -> dict:
    mapping = {}
    forwards = ["_scaled_dot_product_flash_attention_for_cpu"]
    backwards = ["_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward"]
    for name in forwards:
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = _sdpa_forward
    for name in backwards:
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = _sdpa_backward
    return mapping


def _inputs_targets(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A MicroBatch (inputs, targets), an (inputs, targets) pair, or token ids alone (targets = inputs)."""
    if hasattr(batch, "inputs") and hasattr(batch, "targets"):
        return batch.inputs, batch.targets
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor):
        return batch, batch
    raise TypeError(f"batch must be a MicroBatch, an (inputs, targets) pair or a token tensor, got {type(batch).__name__}")


def _loss_head(targets: torch.Tensor):
    def head(hidden, lm_head):
        logits = lm_head(hidden)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    return head


def count_model_flops(model: torch.nn.Module, batch) -> int:
    """FLOPs of forward + cross-entropy + backward of `model` (tokens [B, S] -> logits [B, S, V]) on `batch`.

    Gradients already accumulated in the model are put back afterwards, so a trainer may call this
    mid-step.
    """
    inputs, targets = _inputs_targets(batch)
    device = next(model.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None
    try:
        with FlopCounterMode(display=False, custom_mapping=_attention_mapping()) as counter:
            depth = len(model.mtp) if getattr(model, "mtp", None) is not None else 0
            if depth:  # the MTP modules train with the model: their depths' heads and losses count too
                from ..model.mtp import targets_ahead

                heads = [_loss_head(targets_ahead(targets, k, -100)) for k in range(1, depth + 1)]
                main, ahead = model(inputs, head=_loss_head(targets), mtp_heads=heads)
                loss = main + sum(ahead)
            else:
                logits = model(inputs)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
    finally:
        for p, g in saved.items():
            p.grad = g
    return int(counter.get_total_flops())
