"""The serving estimate: one model on `estimate.serve.tp` GPUs, from the seed's chapter on inference.

- Prefill runs the whole prompt in one forward pass and is compute-bound: TTFT = the larger of the prompt's
  forward FLOPs / (GPUs x peak x MFU) and the time to read the weights once (short prompts).
- Decode produces one token per sequence per step and "reads all the weights and the whole KV cache to do
  only a couple of FLOPs per byte": a step takes max(bytes / bandwidth, FLOPs / peak) (a roofline), with
  bytes = the weights (for MoE only the experts the batch's tokens visit) + every sequence's KV cache.
  TPOT is that step; aggregate output tokens/s = concurrency / step.
- "Serving 64 sequences costs little more per step than serving 1: the weights are read once per step
  either way": throughput climbs almost linearly with concurrency until the KV reads rival the weight
  reads, the step becomes compute-bound, or the KV cache fills memory (the last row of the table).

Each sequence is counted at its average context, prompt + output/2, for the KV it reads and the attention
FLOPs it does; capacity counts it at its final length, prompt + output (what must fit so that no sequence
is preempted). Tensor parallelism splits weights, FLOPs and KV heads over `tp` GPUs (KV heads are
replicated when tp exceeds them, as vLLM does) and adds two all-reduces of the batch's hidden states per
layer (seed: Megatron's column/row split). Everything is per replica; replicas multiply throughput.
"""

from __future__ import annotations

import math

from infra.config.schema import LifecycleConfig

from . import formulas as f

# Rows of the table: concurrency 1, 2, 4, ... up to (and including) the KV-cache limit.
MAX_ROWS = 24


def _power_steps(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit and len(out) < MAX_ROWS - 1:
        out.append(b)
        b *= 2
    return out + [limit] if limit >= 1 else []


class ServeModel:
    """What serving one ModelConfig costs per GPU, for a given weight and KV dtype and tensor-parallel size."""

    def __init__(self, model, *, weight_dtype: str = "bf16", kv_dtype: str = "bf16", tp: int = 1,
                 gpu_peak_flops: float = 989e12, gpu_memory_bandwidth: float = 3.35e12,
                 gpu_memory_bytes: float = 80e9, link_bandwidth: float = 450e9, allreduce_latency_s: float = 1e-5,
                 memory_reserve: float = 0.1, prefill_mfu: float = 0.4, causal_prefill: bool = False):
        if weight_dtype not in f.WEIGHT_DTYPE_BYTES:
            raise ValueError(f"weight dtype must be one of {sorted(f.WEIGHT_DTYPE_BYTES)}, got {weight_dtype!r}")
        if kv_dtype not in f.KV_DTYPE_BYTES:
            raise ValueError(f"KV dtype must be one of {sorted(f.KV_DTYPE_BYTES)}, got {kv_dtype!r}")
        if tp < 1:
            raise ValueError(f"serving tp must be >= 1, got {tp}")
        self.model, self.tp = model, tp
        self.peak, self.bandwidth, self.memory = gpu_peak_flops, gpu_memory_bandwidth, gpu_memory_bytes
        self.link, self.latency, self.reserve = link_bandwidth, allreduce_latency_s, memory_reserve
        self.prefill_mfu, self.causal_prefill = prefill_mfu, causal_prefill
        wb = f.WEIGHT_DTYPE_BYTES[weight_dtype]
        counts = f.param_counts(model)
        layers = f.model_layer_params(model)
        bf16 = 2.0
        # The layers' weights in the chosen dtype; embedding table, LM head and final norm stay bf16.
        self.weight_bytes = (sum(x["total"] for x in layers) * wb
                             + (counts["embedding"] + counts["head"] + model.dim) * bf16)
        # Read every decode step: the dense part of each layer, the LM head's V x h matmul (the embedding
        # table itself when tied), the final norm. The embedding lookup reads only the batch's rows.
        self.dense_read = (sum(x["total"] - x["routed"] for x in layers) * wb
                           + (model.vocab_size * model.dim + model.dim) * bf16)
        moe = model.moe
        self.moe_layers = sum(1 for x in layers if x["routed"])
        self.expert_bytes = (layers[moe.every - 1]["routed"] / moe.num_experts * wb) if self.moe_layers else 0.0
        self.counts = counts
        self.q_dim = model.n_heads * model.head_size
        self.kv_heads_per_gpu = math.ceil(model.kv_heads / tp)
        kv_bytes = f.KV_DTYPE_BYTES[kv_dtype]
        self.kv_per_token = f.kv_bytes_per_token(model.n_layers, model.kv_heads, model.head_size, kv_bytes)
        self.kv_per_token_gpu = f.kv_bytes_per_token(model.n_layers, self.kv_heads_per_gpu, model.head_size, kv_bytes)

    # --------------------------------------------------------------------------------------- memory

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.tp

    def capacity_tokens(self) -> float:
        return f.kv_capacity_tokens(self.memory, self.reserve, self.weight_bytes_per_gpu, self.kv_per_token_gpu)

    def max_sequences(self, context: int) -> int:
        """Sequences of `context` tokens whose KV cache fits beside the weights at once."""
        return int(self.capacity_tokens() // context)

    # --------------------------------------------------------------------------------------- time

    def weights_read(self, tokens: float) -> float:
        """Weight bytes one forward over `tokens` tokens reads on one GPU: all dense weights, and of each MoE
        layer's experts only those the tokens visit (exactly top_k for one token)."""
        moe = self.model.moe
        experts = f.experts_touched(moe.num_experts, moe.top_k, tokens) if self.moe_layers else 0.0
        rows = tokens * self.model.dim * 2.0  # the embedding rows looked up
        return (self.dense_read + self.moe_layers * experts * self.expert_bytes + rows) / self.tp

    def _tp_allreduce_s(self, tokens: float) -> float:
        """Two all-reduces of [tokens, h] bf16 per layer (attention's and the MLP's row-split outputs)."""
        if self.tp == 1:
            return 0.0
        size = tokens * self.model.dim * 2.0
        return 2 * self.model.n_layers * (f.ring_allreduce_bytes(size, self.tp) / self.link + self.latency)

    def forward_flops(self, context: float, causal: bool = False) -> float:
        """Forward FLOPs of one token attending to `context` positions: a third of the training figure
        (formulas.flops_per_token: 2 per multiply-add of every active matmul weight, plus attention)."""
        m = self.model
        return f.flops_per_token(self.counts["active"], self.counts["embedding"], m.tie_embeddings, m.n_layers,
                                 context, self.q_dim, causal) / 3

    def decode_step(self, concurrency: int, context: float) -> dict:
        """One decode step for `concurrency` sequences of average `context` tokens, on one GPU of the replica."""
        b = concurrency
        weights = self.weights_read(b)
        kv = b * context * self.kv_per_token_gpu
        flops = b * self.forward_flops(context) / self.tp
        roof, bound = f.roofline_time(weights + kv, flops, self.bandwidth, self.peak)
        if bound == "memory":
            bound = "weights" if weights >= kv else "kv_reads"
        comm = self._tp_allreduce_s(b)
        step = roof + comm
        return {"concurrency": b, "step_s": step, "tpot_s": step, "tokens_per_s": b / step, "bound": bound,
                "weight_bytes": weights, "kv_bytes": kv, "flops": flops, "memory_s": (weights + kv) / self.bandwidth,
                "compute_s": flops / self.peak, "tp_comm_s": comm}

    def prefill(self, prompt: int) -> dict:
        """TTFT of one prompt on an idle replica: compute at peak x MFU, or reading the weights once,
        whichever is longer, plus the tensor-parallel all-reduces."""
        flops = prompt * self.forward_flops(prompt, self.causal_prefill) / self.tp
        compute = flops / (self.peak * self.prefill_mfu)
        weights = self.weights_read(prompt) / self.bandwidth
        comm = self._tp_allreduce_s(prompt)
        return {"ttft_s": max(compute, weights) + comm, "flops": flops * self.tp, "compute_s": compute,
                "weights_s": weights, "tp_comm_s": comm, "bound": "compute" if compute >= weights else "weights"}

    # --------------------------------------------------------------------------------------- bends

    def _first(self, pred, limit: int = 1 << 24) -> int | None:
        """Smallest concurrency in [1, limit] where `pred` holds (it stays true once true), or None."""
        if not pred(limit):
            return None
        lo, hi = 1, limit
        while lo < hi:
            mid = (lo + hi) // 2
            if pred(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def knees(self, context: float) -> dict[str, int | None]:
        """Where the throughput curve bends: the KV reads of the batch reach the weight reads (the step has
        doubled from concurrency 1's weight read), or the step turns compute-bound."""
        def kv_reads(b: int) -> bool:
            return b * context * self.kv_per_token_gpu >= self.weights_read(b)

        def compute(b: int) -> bool:
            return self.decode_step(b, context)["bound"] == "compute"

        return {"kv_reads": self._first(kv_reads), "compute": self._first(compute)}


def serve_model(cfg: LifecycleConfig) -> ServeModel:
    """The ServeModel for a config's model, GPU and `estimate.serve` settings."""
    est, sv, par = cfg.estimate, cfg.estimate.serve, cfg.parallel
    tp = sv.tp or par.tp
    # A replica wider than a node talks over the network (seed: "TP = 8, one full node, is the usual ceiling").
    link = est.intra_node_bandwidth if tp <= par.nproc_per_node else est.inter_node_bandwidth
    return ServeModel(cfg.model, weight_dtype=sv.weight_dtype, kv_dtype=sv.kv_dtype, tp=tp,
                      gpu_peak_flops=est.gpu_peak_flops, gpu_memory_bandwidth=est.gpu_memory_bandwidth,
                      gpu_memory_bytes=est.gpu_memory_bytes, link_bandwidth=link,
                      allreduce_latency_s=sv.allreduce_latency_s, memory_reserve=sv.memory_reserve,
                      prefill_mfu=sv.prefill_mfu or est.mfu, causal_prefill=est.attention_flops == "causal")


def serving_table(sm: ServeModel, prompt: int, output: int, limit: int | None = None) -> list[dict]:
    """Decode steps at concurrency 1, 2, 4, ... up to the KV-cache limit (its last row), at the average
    context prompt + output/2."""
    limit = sm.max_sequences(prompt + output) if limit is None else limit
    return [sm.decode_step(b, prompt + output / 2) for b in _power_steps(limit)]


def estimate_serving(cfg: LifecycleConfig) -> dict:
    """Every serving figure for `cfg` (JSON-ready): capacity, TTFT, TPOT and throughput by concurrency, bends."""
    sv = cfg.estimate.serve
    sm = serve_model(cfg)
    prompt, output = sv.prompt_len, sv.output_len
    notes = []
    if prompt + output > cfg.model.max_seq_len:  # as the serve stage's load test: both shrink to fit the context
        scale = cfg.model.max_seq_len / (prompt + output)
        prompt, output = max(1, int(prompt * scale)), max(1, int(output * scale))
        notes.append(f"prompt + output = {sv.prompt_len} + {sv.output_len} exceeds model.max_seq_len = "
                     f"{cfg.model.max_seq_len}: estimated at {prompt} + {output}")
    context, average = prompt + output, prompt + output / 2
    limit = sm.max_sequences(context)
    table = serving_table(sm, prompt, output, limit)
    one, prefill = sm.decode_step(1, average), sm.prefill(prompt)
    knees = sm.knees(average)
    # The bend: the first of KV reads rivalling weights, compute-bound, or a full KV cache.
    bends = [(b, why) for why, b in (("kv_reads", knees["kv_reads"]), ("compute", knees["compute"]),
                                      ("kv_capacity", limit)) if b is not None and b >= 1]
    knee, why = min(bends) if bends and limit >= 1 else (None, "weights_do_not_fit")
    if limit < 1:
        notes.append(f"the weights ({sm.weight_bytes_per_gpu / 1e9:.1f} GB per GPU at tp={sm.tp}) leave no room for "
                     f"one {context}-token sequence in {sm.memory / 1e9:.0f} GB; raise estimate.serve.tp or quantize")
    return {
        "tp": sm.tp, "weight_dtype": sv.weight_dtype, "kv_dtype": sv.kv_dtype,
        "prompt_len": prompt, "output_len": output, "context": context, "average_context": average,
        "gpu_memory_bandwidth": sm.bandwidth, "memory_reserve": sm.reserve, "prefill_mfu": sm.prefill_mfu,
        "weight_bytes": sm.weight_bytes, "weight_bytes_per_gpu": sm.weight_bytes_per_gpu,
        "weight_read_bytes_per_step": sm.weights_read(1) * sm.tp,
        "kv_bytes_per_token": sm.kv_per_token, "kv_bytes_per_token_per_gpu": sm.kv_per_token_gpu,
        "kv_capacity_tokens": sm.capacity_tokens() * 1.0, "max_concurrency": limit,
        "prefill": prefill, "ttft_s": prefill["ttft_s"],
        "tpot_s": one["tpot_s"], "tokens_per_s_one": one["tokens_per_s"],
        "peak_tokens_per_s": max((r["tokens_per_s"] for r in table), default=0.0),
        "knee_concurrency": knee, "knee_reason": why, "knees": knees, "table": table, "notes": notes,
    }
