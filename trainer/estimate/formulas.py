"""The seed's arithmetic as pure functions: parameters, bytes of state, activations, FLOPs, collective
bytes, KV cache, and the serving roofline. Plain numbers in, plain numbers out; no torch, nothing allocated.

Conventions (and where they come from):
- Model state: 2 (bf16 weight) + 2 (bf16 gradient) + 4 + 4 + 4 (fp32 master, Adam m, Adam v) = 16 bytes
  per parameter; 18 when gradients accumulate in fp32 (seed, "Matrix multiplies run in bf16").
- Activations per layer per micro-batch: Korthikanti et al. 2022, s*b*h*(34 + 5*a*s/h) bytes (bf16,
  GPT-style layer), 34*s*b*h/t with FlashAttention (or selective recompute) and sequence parallel,
  2*s*b*h (the layer's input) with full recompute. The 34 is counted for a GPT layer (4h GeLU MLP,
  full K/V heads, dropout); the seed uses it as is, and so do we: a SwiGLU layer with grouped KV heads
  and no dropout differs by some tens of percent.
- Training FLOPs: 6 x parameters x tokens (2 forward + 4 backward per multiply-add), less the
  embedding (a lookup, not a matmul), plus attention. The attention term counts the two s x s matmuls
  (QK^T and scores x V) forward and twice that backward over the *whole* score matrix:
  12 * layers * s * (heads * head_dim) FLOPs per token. That is PaLM's MFU convention (Chowdhery et al.
  2022, appendix B), the s/(6h) term of Narayanan et al. 2021, and what torch's FLOP counter reports for
  attention (it ignores the causal mask). For the seed, 12 * 5 * 2,048 * 4,096 * 32,768 = 16.5 TFLOP: the
  seed's "~16 TFLOP of attention". Counting only the causal lower triangle halves it (8.2 TFLOP);
  `estimate.attention_flops: causal` selects that.
"""

from __future__ import annotations

import math

YEAR_S = 365.25 * 24 * 3600


# --------------------------------------------------------------------------------------------- parameters


def layer_params(dim: int, n_heads: int, kv_heads: int, head_dim: int, ffn_dim: int, *, qk_norm: bool = False,
                 num_experts: int = 0, top_k: int = 0, expert_ffn_dim: int | None = None,
                 shared_expert: bool = False) -> dict[str, int]:
    """One block's parameters: attention (q, k, v, o), two RMSNorms, and a SwiGLU MLP or an MoE.

    Returns total, active (per token: top_k of the routed experts), routed (the experts' share), and
    tp_whole: what tensor parallelism does not split (trainer/parallel/tensor_parallel.py): the norm gains,
    and an MoE layer's router and shared expert (MoE layers stay whole on every tp rank; their routed
    experts are split by expert parallelism only).
    """
    attention = dim * n_heads * head_dim * 2 + dim * kv_heads * head_dim * 2  # q, o and k, v (GQA)
    norms = 2 * dim + (2 * head_dim if qk_norm else 0)
    if num_experts:
        expert = 3 * dim * (expert_ffn_dim or ffn_dim)  # gate, up, down
        router = dim * num_experts
        shared = expert if shared_expert else 0
        routed = num_experts * expert
        total = attention + norms + router + shared + routed
        active = attention + norms + router + shared + top_k * expert
        return {"total": total, "active": active, "routed": routed, "tp_whole": norms + router + shared}
    mlp = 3 * dim * ffn_dim
    total = attention + norms + mlp
    return {"total": total, "active": total, "routed": 0, "tp_whole": norms}


def model_layer_params(model) -> list[dict[str, int]]:
    """layer_params for every block of a ModelConfig (MoE on layers i with i % every == every - 1)."""
    out = []
    moe = model.moe
    for i in range(model.n_layers):
        is_moe = moe is not None and i % moe.every == moe.every - 1
        out.append(layer_params(
            model.dim, model.n_heads, model.kv_heads, model.head_size, model.ffn_dim, qk_norm=model.qk_norm,
            num_experts=moe.num_experts if is_moe else 0, top_k=moe.top_k if is_moe else 0,
            expert_ffn_dim=moe.ffn_dim if is_moe else None, shared_expert=bool(is_moe and moe.shared_expert),
        ))
    return out


def mtp_params(model) -> dict[str, int]:
    """The model.mtp_depth MTP modules' parameters (trainer/model/mtp.py), each: three RMSNorms (h, the
    embedding, its output), the 2h -> h projection and one block of the last layer's kind; the
    embedding and LM head are the model's own. tp_whole as in layer_params (+ the three norms)."""
    depth = getattr(model, "mtp_depth", 0)
    if not depth:
        return {"total": 0, "active": 0, "routed": 0, "tp_whole": 0}
    block = model_layer_params(model)[-1]
    extra = 3 * model.dim + 2 * model.dim * model.dim
    return {"total": depth * (block["total"] + extra), "active": depth * (block["active"] + extra),
            "routed": depth * block["routed"], "tp_whole": depth * (block["tp_whole"] + 3 * model.dim)}


def param_counts(model) -> dict[str, int]:
    """Total and active-per-token parameters of a ModelConfig; the embedding table and the LM head apart.

    `embedding` is the lookup table (no FLOPs); `head` the output projection (V x h FLOPs per token); a
    tied head shares the table, so it adds no parameters but still costs its matmul. `mtp`: the MTP
    modules' share of total (mtp_params).
    """
    layers = model_layer_params(model)
    mtp = mtp_params(model)
    embedding = model.vocab_size * model.dim
    head = 0 if model.tie_embeddings else model.vocab_size * model.dim
    final_norm = model.dim
    total = embedding + head + final_norm + sum(x["total"] for x in layers) + mtp["total"]
    active = embedding + head + final_norm + sum(x["active"] for x in layers) + mtp["active"]
    return {"total": total, "active": active, "embedding": embedding, "head": head,
            "routed": sum(x["routed"] for x in layers) + mtp["routed"], "mtp": mtp["total"]}


def mtp_flops_per_token(model, seq_len: int, causal: bool = False) -> float:
    """What the MTP modules add beyond 6 x their own parameters (counted in `active`): each depth runs the
    shared LM head once more (6 V h per token) and one more layer of attention."""
    depth = getattr(model, "mtp_depth", 0)
    return depth * (6 * model.vocab_size * model.dim
                    + attention_flops_per_token(1, seq_len, model.n_heads * model.head_size, causal))


# ----------------------------------------------------------------------------------------- model state


def state_bytes_per_param(precision: str = "bf16", fp32_grad_accum: bool = False,
                          optimizer: str = "adamw", fsdp: bool = False) -> dict[str, int]:
    """Bytes per parameter of weights, gradients and optimizer state (seed: 2 + 2 + 12 = 16; 18 with
    fp32 gradient accumulation). fp32 training keeps no separate master copy (4 + 4 + 8 = 16).
    SGD keeps one momentum buffer instead of Adam's two moments. FSDP2 under bf16 (trainer/parallel/fsdp.py)
    keeps fp32 parameter shards that are the masters and fp32 gradient shards, gathering bf16 only for
    compute: 4 + 4 + 8 = 16 with or without fp32 gradient reduction. fp8 holds what bf16 holds (torchao's
    Float8Linear keeps bf16 weights and casts them to float8 per matmul: trainer/precision.py)."""
    if precision not in ("bf16", "fp32", "fp8"):
        raise ValueError(f"precision must be bf16, fp8 or fp32, got {precision!r}")
    precision = "bf16" if precision == "fp8" else precision
    weights = 2 if precision == "bf16" else 4
    grads = 4 if (fp32_grad_accum or precision == "fp32") else 2
    moments = {"adamw": 8, "sgd": 4}.get(optimizer)
    if moments is None:
        raise ValueError(f"optimizer must be adamw or sgd, got {optimizer!r}")
    master = 4 if precision == "bf16" else 0
    if fsdp:
        return {"weights": 4, "grads": 4, "optimizer": moments}
    return {"weights": weights, "grads": grads, "optimizer": master + moments}


def zero_state_bytes(params: float, per_param: dict[str, int], zero: int, shard: int) -> dict[str, float]:
    """One rank's state under ZeRO (Rajbhandari et al. 2020) sharded `shard` ways:
    stage 0 keeps everything, 1 shards the optimizer, 2 also the gradients, 3 also the weights."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")
    if shard < 1:
        raise ValueError(f"shard degree must be >= 1, got {shard}")
    w, g, o = (params * per_param[k] for k in ("weights", "grads", "optimizer"))
    return {
        "weights": w / shard if zero >= 3 else w,
        "grads": g / shard if zero >= 2 else g,
        "optimizer": o / shard if zero >= 1 else o,
    }


# ------------------------------------------------------------------------------------------ activations


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, *, tp: int = 1, sequence_parallel: bool = False,
                               flash_attention: bool = True, recompute: str = "none", act_bytes: int = 2,
                               moe_top_k: int = 0) -> float:
    """Bytes one layer keeps for backward, per micro-batch of b sequences of s tokens (Korthikanti et al.).

    Without recompute: s*b*h*(34 + 5*a*s/h) for the GPT layer (11 attention + 19 MLP + 4 norm terms of s*b*h,
    and 5*a*s^2*b for the softmax scores, its dropout mask and output). Tensor parallelism divides the
    matmul-side terms by t; sequence parallelism divides the remaining 10 (norms, dropouts, residual) too.
    FlashAttention never stores the s x s scores (selective recompute drops them the same way). Full
    recompute keeps only the layer's input: 2*s*b*h, split along the sequence under sequence parallel.
    An MoE layer keeps its MLP intermediates (16*s*b*h) for each of the top_k experts a token visits.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    sbh = s * b * h
    scale = act_bytes / 2  # the formula counts bf16 values
    if recompute == "full":
        return 2 * sbh * scale / (tp if sequence_parallel else 1)
    # The 24 that tensor parallelism splits: 8 in attention (Q, K, V, the output projection's input) and
    # 16 in the MLP (its two 4h-wide intermediates), the MLP's repeated for each expert a token visits.
    matmul_side = 8 * sbh + 16 * sbh * (moe_top_k if moe_top_k else 1)
    replicated = 10 * sbh  # norm inputs, matmul inputs, dropout masks: split only by sequence parallelism
    scores = 0 if (flash_attention or recompute == "selective") else 5 * a * s * s * b
    per_rank = (matmul_side + scores) / tp + replicated / (tp if sequence_parallel else 1)
    return per_rank * scale


def logits_bytes(s: int, b: int, vocab: int, tp: int = 1) -> float:
    """fp32 logits of one micro-batch on the last stage: 4*s*b*V/t (vocab-parallel splits V)."""
    return 4 * s * b * vocab / tp


# ------------------------------------------------------------------------------------------------ FLOPs


def attention_flops_per_token(n_layers: int, seq_len: int, q_dim: int, causal: bool = False) -> float:
    """QK^T and scores x V, forward and backward: 12 * layers * s * (heads * head_dim) per token over the
    full score matrix (PaLM/Megatron convention); half of it when only the causal triangle is counted."""
    full = 12 * n_layers * seq_len * q_dim
    return full / 2 if causal else full


def flops_per_token(active_params: int, embedding: int, tied: bool, n_layers: int, seq_len: int, q_dim: int,
                    causal: bool = False) -> float:
    """6 x (active parameters less the embedding lookup) + attention. A tied head is the embedding table
    used as a matmul, so it is not subtracted."""
    matmul_params = active_params - (0 if tied else embedding)
    return 6 * matmul_params + attention_flops_per_token(n_layers, seq_len, q_dim, causal)


# ------------------------------------------------------------------------------------------ collectives


def ring_allreduce_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce: 2 * (n - 1)/n of the buffer (seed, "the ring")."""
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def ring_shard_bytes(size: float, n: int) -> float:
    """Bytes each rank sends in a ring reduce-scatter or all-gather of a `size`-byte buffer: (n - 1)/n."""
    return (n - 1) / n * size if n > 1 else 0.0


def data_parallel_bytes(params: float, zero: int, n: int, *, grad_bytes: int = 2, weight_bytes: int = 2,
                        micro_batches: int = 1, replicate: int = 1, reductions: int = 1) -> float:
    """Bytes one rank sends per step to keep `n` data-parallel ranks in step.

    ZeRO 0: all-reduce of the gradient, 2(n-1)/n G. ZeRO 1/2: reduce-scatter of the gradient and all-gather
    of the updated bf16 weights, the same bytes as one all-reduce (seed: "free memory"). ZeRO 3: the weights
    are all-gathered for every forward and every backward, plus the reduce-scatter: 1.5x DDP's traffic for
    one micro-batch (seed), and two more gathers for each further micro-batch. HSDP (`replicate` > 1)
    all-reduces each rank's gradient shard across the replicas as well. `reductions`: gradient
    reduce-scatters (and HSDP all-reduces) per step, 1 where micro-batches accumulate before it (ZeRO 1,
    FSDP inside a pipeline schedule), m for FSDP's ZeRO 2/3, which keeps gradients sharded by reducing
    every micro-batch (trainer/parallel/fsdp.py): ZeRO 2 then moves (m + 1)/2 and ZeRO 3 3m/2 of DDP.
    """
    g, w = params * grad_bytes, params * weight_bytes
    if zero == 0:
        return ring_allreduce_bytes(g, n)
    hsdp = reductions * hsdp_allreduce_bytes(params, grad_bytes, n, replicate)
    if zero == 1:
        return ring_shard_bytes(g, n) + ring_shard_bytes(w, n) + hsdp
    if zero == 2:
        return reductions * ring_shard_bytes(g, n) + ring_shard_bytes(w, n) + hsdp
    if zero == 3:
        return 2 * micro_batches * ring_shard_bytes(w, n) + reductions * ring_shard_bytes(g, n) + hsdp
    raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero!r}")


def hsdp_allreduce_bytes(params: float, grad_bytes: float, n: int, replicate: int) -> float:
    """HSDP's share of data-parallel traffic: each rank's gradient shard (1/n) all-reduced across replicas."""
    return ring_allreduce_bytes(params * grad_bytes / n, replicate)


def tensor_parallel_bytes(act_tensor: float, t: int, *, dense_layers: int, moe_layers: int = 0,
                          holds_embedding: bool = False, holds_head: bool = False, tokens: int = 0,
                          sequence_parallel: bool = False, norm_gains: int = 0, gain_bytes: float = 2,
                          micro_batches: int = 1) -> float:
    """Bytes one tensor-parallel rank sends per step (trainer/parallel/tensor_parallel.py, vocab_parallel.py).

    Per micro-batch, in all-reduces of one [b, s, h] activation (`act_tensor` bytes; sequence parallel swaps
    each for a reduce-scatter + all-gather, the same bytes, seed): 2 forward and 2 backward per layer (seed);
    an MoE layer (not split over tp) only its attention's 2, plus under sequence parallel the gather of its
    input and, backward, of its output's gradient; the vocab-parallel embedding's all-reduce forward ("an
    all-reduce fills in the rest") and the LM head's input gradient backward; and the cross-entropy's "three
    tiny all-reduces" of one fp32 value per position (max, sum of exponentials, target logit). Once a step,
    under sequence parallel: the norm gains' gradients, partial on each rank (each saw part of the sequence).
    Not counted: the gradient norm's scalars."""
    if t <= 1:
        return 0.0
    tensors = 4 * dense_layers + (3 if sequence_parallel else 2) * moe_layers + holds_embedding + holds_head
    per_micro = tensors * ring_allreduce_bytes(act_tensor, t)
    if holds_head:
        per_micro += 3 * ring_allreduce_bytes(4 * tokens, t)
    gains = ring_allreduce_bytes(norm_gains * gain_bytes, t) if sequence_parallel else 0.0
    return micro_batches * per_micro + gains


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Slots per expert for `tokens` routed tokens: ceil(factor * tokens * top_k / E), at least one (Switch
    Transformer; trainer.model.moe.MoE.capacity)."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def kv_bytes_per_token(n_layers: int, kv_heads: int, head_dim: int, bytes_per_value: float = 2) -> float:
    """KV cache per token: 2 (K and V) x layers x KV heads x head size x bytes (seed: 80 KB; 20 KB with GQA 8)."""
    return 2 * n_layers * kv_heads * head_dim * bytes_per_value


# ---------------------------------------------------------------------------------------------- serving

# Bytes per stored value. INT4 weight-only (AWQ, GPTQ) is counted at half a byte, without its group scales
# (one bf16 scale per 128 weights adds 1/64 byte).
WEIGHT_DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0, "int4": 0.5}
KV_DTYPE_BYTES = {"bf16": 2.0, "fp8": 1.0}


def experts_touched(num_experts: int, top_k: int, tokens: float) -> float:
    """Expected distinct experts of one MoE layer that `tokens` tokens visit, each picking top_k of
    num_experts uniformly: E * (1 - (1 - k/E)^n). One token reads exactly its top_k experts; a large batch
    reads them all, so batched MoE decode loses the active-parameter discount on bandwidth."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def roofline_time(bytes_moved: float, flops: float, bandwidth: float, peak_flops: float) -> tuple[float, str]:
    """(seconds, "memory" or "compute"): a kernel takes as long as the slower of reading its bytes and doing
    its FLOPs (Williams et al. 2009). Decode does a couple of FLOPs per byte against an H100's ~300 FLOP
    per byte of bandwidth, so it sits on the memory side (seed, "bound by memory bandwidth")."""
    memory, compute = bytes_moved / bandwidth, flops / peak_flops
    return (compute, "compute") if compute > memory else (memory, "memory")


def kv_capacity_tokens(gpu_memory: float, reserve: float, weight_bytes_per_gpu: float,
                       kv_bytes_per_token_per_gpu: float) -> float:
    """Tokens of KV cache one GPU holds: what is left of its memory after the runtime's reserve (a share)
    and its weights, divided by one token's K and V on that GPU. Zero when the weights do not fit."""
    free = gpu_memory * (1 - reserve) - weight_bytes_per_gpu
    return max(free, 0.0) / kv_bytes_per_token_per_gpu


# ------------------------------------------------------------------------------------- pipeline split


def split_layers(layer_costs: list[float], chunks: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Contiguous layer counts for `chunks` pipeline chunks minimising the most expensive chunk, with the
    embedding's cost on the first and the head and loss's on the last (seed: "the last stage gets fewer
    layers"). Every chunk gets at least one layer. Exact: a DP over split points."""
    n = len(layer_costs)
    if chunks < 1 or chunks > n:
        raise ValueError(f"cannot split {n} layers into {chunks} pipeline chunks")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[k][i]: minimal max cost placing the first i layers into k chunks; cut[k][i] the last cut.
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                cost = prefix[i] - prefix[j] + (first_extra if k == 1 else 0) + (last_extra if k == chunks else 0)
                worst = max(best[k - 1][j], cost)
                if worst < best[k][i] - 1e-9:
                    best[k][i], cut[k][i] = worst, j
    counts, i = [], n
    for k in range(chunks, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]
