"""Activation-aware weight quantization (Lin et al. 2023, AWQ): before rounding to INT4, scale up the
input channels that carry large activations, so their weights lose less to rounding, and fold the
inverse scale into the operation that produces those inputs. The model computes the same function in
full precision (exact up to float rounding); only the rounding error moves to channels that matter less.

For each group of linears sharing one input x, with s = mean|x|^alpha (normalised), the loss of a
candidate alpha is sum over the group of || x W^T - (x / s) Q(W diag(s))^T ||^2 on calibration tokens,
and alpha is picked by grid search over [0, 1); alpha = 0 is plain round-to-nearest, so AWQ never does
worse than RTN on the calibration objective. Groups per block (where 1/s is folded):
  q, k, v        <- input_layernorm weight
  gate, up (all experts and the shared expert; the router, not quantized, gets columns * s)
                 <- post_attention_layernorm weight
  o              <- v_proj rows (one scale per KV-head channel: query heads sharing a KV head share it)
  down (each MLP / expert)  <- its up_proj rows
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from infra.config.model import ModelConfig

from .quantize import dequant_int4, int4_groupwise

MAX_SAMPLES = 2048  # calibration rows kept per linear for the loss


def collect_inputs(model: nn.Module, rows: torch.Tensor, batch: int = 4) -> dict[str, torch.Tensor]:
    """Inputs [n, in] of every nn.Linear inside the blocks over the calibration token rows (at most
    MAX_SAMPLES rows each, evenly spaced over the tokens seen)."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.startswith("layers."):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args, name=name: seen[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())))
    try:
        with torch.no_grad():
            for i in range(0, rows.shape[0], batch):
                model(rows[i:i + batch])
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, xs in seen.items():
        x = torch.cat(xs)
        if x.shape[0] > MAX_SAMPLES:
            x = x[torch.linspace(0, x.shape[0] - 1, MAX_SAMPLES).long()]
        out[name] = x
    return out


def _rtn(w: torch.Tensor, group: int) -> torch.Tensor:
    q, s = int4_groupwise(w, group)
    return dequant_int4(q, s)


def best_scale(x: torch.Tensor, weights: list[torch.Tensor], group: int, grid: int,
               tie: tuple[int, int] | None = None) -> tuple[torch.Tensor, float, float]:
    """The AWQ scale s [in] for linears `weights` ([out_i, in]) sharing input x [n, in]. `tie=(K, g)`
    constrains s to be equal across the g query heads of each of K KV heads (for o_proj). Returns
    (s, loss at the chosen alpha, loss at alpha=0)."""
    if x.shape[0] == 0:
        return torch.ones(x.shape[1]), 0.0, 0.0
    mean = x.abs().mean(dim=0)
    if tie is not None:
        K, g = tie
        mean = mean.view(K, g, -1).mean(dim=1, keepdim=True).expand(K, g, mean.numel() // (K * g)).reshape(-1)
    refs = [x @ w.float().t() for w in weights]
    best: tuple[float, torch.Tensor] | None = None
    base = 0.0
    for i in range(grid):
        alpha = i / grid
        s = mean.clamp_min(1e-8).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # AWQ's normalisation: scales centred around 1
        loss = 0.0
        for w, ref in zip(weights, refs):
            wq = _rtn(w.float() * s, group)
            loss += float(((x / s) @ wq.t() - ref).pow(2).sum())
        if i == 0:
            base = loss
        if best is None or loss < best[0]:
            best = (loss, s)
    return best[1], best[0], base


@torch.no_grad()
def awq_scale(sd: dict[str, torch.Tensor], cfg: ModelConfig, rows: torch.Tensor, group: int = 128,
              grid: int = 20) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """An equivalent state dict (our names) with AWQ scales folded in, ready for INT4 round-to-nearest;
    and {"loss_awq", "loss_rtn"}: the calibration objective summed over all groups, AWQ vs plain RTN."""
    from trainer.model import Transformer

    ref_cfg = cfg if cfg.moe is None else cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"capacity_factor": None})})
    model = Transformer(ref_cfg)
    model.load_state_dict(sd)
    model.eval()
    inputs = collect_inputs(model, rows)
    out = {k: v.clone().float() for k, v in sd.items()}
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    totals = {"loss_awq": 0.0, "loss_rtn": 0.0}

    def fits(names: list[str]) -> bool:
        return all(out[n].shape[1] % group == 0 for n in names)

    def apply(x: torch.Tensor, linears: list[str], scale_rows: list[str], scale_cols: list[str],
              tie=None, divide_rows_of: str | None = None) -> None:
        if not fits(linears):
            return
        s, loss, base = best_scale(x, [out[n] for n in linears], group, grid, tie)
        totals["loss_awq"] += loss
        totals["loss_rtn"] += base
        for n in linears + scale_cols:
            out[n] = out[n] * s  # columns (inputs) scaled up
        for n in scale_rows:  # a norm weight: the producer of x, scaled down
            out[n] = out[n] / s
        if divide_rows_of is not None:  # a linear producing x: its output rows scaled down
            s_rows = s if tie is None else s.view(tie[0], tie[1], -1)[:, 0].reshape(-1)
            out[divide_rows_of] = out[divide_rows_of] / s_rows[:, None]

    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        attn = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
        apply(inputs[p + "self_attn.q_proj"], attn, [p + "input_layernorm.weight"], [])
        K, H = cfg.kv_heads, cfg.n_heads
        apply(inputs[p + "self_attn.o_proj"], [p + "self_attn.o_proj.weight"], [], [], tie=(K, H // K),
              divide_rows_of=p + "self_attn.v_proj.weight")
        mlp = model.layers[str(i)].mlp
        if hasattr(mlp, "experts"):
            mlps = [f"{p}mlp.experts.{e}." for e in range(len(mlp.experts))]
            if mlp.shared_expert is not None:
                mlps.append(p + "mlp.shared_expert.")
            x_in, router = inputs[p + "mlp.gate"], [p + "mlp.gate.weight"]
        else:
            mlps, x_in, router = [p + "mlp."], inputs[p + "mlp.gate_proj"], []
        ins = [m + f"{n}_proj.weight" for m in mlps for n in ("gate", "up")]
        apply(x_in, ins, [p + "post_attention_layernorm.weight"], router)
        for m in mlps:
            x_down = inputs.get(m + "down_proj", torch.zeros(0, out[m + "down_proj.weight"].shape[1]))
            apply(x_down, [m + "down_proj.weight"], [], [], divide_rows_of=m + "up_proj.weight")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out, totals
