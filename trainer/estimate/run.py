"""Everything `eightfold estimate` reports for one LifecycleConfig, assembled from `formulas` and a played
pipeline schedule. A pure function of the config: no torch, nothing allocated.

Layout rules it assumes (those of `trainer/parallel/`): ranks ordered dp (dp_replicate x dp_shard), pp,
cp, tp (tp innermost); pipeline chunk c (of pp x pp_virtual_stages) lives on pipeline rank c % pp;
tensor parallelism splits every matrix (and the vocabulary) t ways but norm gains and MoE layers, whose
experts are split over ep only;
ZeRO shards dense state over dp x cp ranks (dp_shard x cp under ZeRO 2/3 with HSDP) and expert state
over the dp x cp / ep ranks that hold the same experts.
"""

from __future__ import annotations

from infra.config.schema import LifecycleConfig

from . import formulas as f
from .links import group_links, link_time, pipeline_warning, placement_warnings
from .schedule import SCHEDULES, bubble_fraction, play
from .serving import estimate_serving

# The `--json` keys scripts may rely on (more may be added, none removed).
JSON_KEYS = (
    "params", "active_params", "state_bytes", "state_bytes_per_rank", "flops_per_step", "step_time_s",
    "tokens_per_s", "tp_allreduce_bytes", "kv_bytes_per_token", "bubble_fraction", "busiest_rank_bytes",
    "comm_time_s_per_step", "warnings", "serve", "serve_max_concurrency", "serve_ttft_s", "serve_tpot_s",
    "serve_peak_tokens_per_s",
)


def recompute_mode(cfg: LifecycleConfig) -> str:
    return cfg.estimate.activation_recompute or cfg.pretrain.activation_checkpointing


def chunk_layers(cfg: LifecycleConfig) -> list[list[int]]:
    """The global layer ids of every pipeline chunk, from `parallel.pp_split` or balanced on FLOPs."""
    m, p = cfg.model, cfg.parallel
    chunks = p.pp * p.pp_virtual_stages
    if isinstance(p.pp_split, list):
        counts = p.pp_split
    else:
        s, q_dim = cfg.pretrain.seq_len, m.n_heads * m.head_size
        costs = [6 * x["active"] + 12 * s * q_dim for x in f.model_layer_params(m)]
        counts = f.split_layers(costs, chunks, last_extra=6 * m.vocab_size * m.dim)
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def _pipeline(cfg: LifecycleConfig, m: int):
    """(timeline or None, simulated schedule name, note): the schedule played for memory and bubble."""
    p = cfg.parallel
    v = p.pp_virtual_stages
    schedule, note = p.pp_schedule, ""
    if schedule not in SCHEDULES:
        note = f"{schedule} is estimated as interleaved_1f1b with v={v} (zero-bubble schedules do better)"
        schedule = "interleaved_1f1b"
    if schedule == "interleaved_1f1b" and m % p.pp:
        note = f"interleaved 1F1B needs m % p == 0 (m={m}, p={p.pp}); memory uses Korthikanti's factor"
        return None, schedule, note
    return play(schedule, p.pp, m, v if schedule == "interleaved_1f1b" else 1), schedule, note


def estimate_run(cfg: LifecycleConfig) -> dict:
    """Every figure for `cfg`, as a JSON-ready dict (bytes, FLOPs, seconds; see JSON_KEYS)."""
    model, par, train, est = cfg.model, cfg.parallel, cfg.pretrain, cfg.estimate
    counts = f.param_counts(model)
    layers = f.model_layer_params(model)
    mtp = f.mtp_params(model)
    # ZeRO-3 is FSDP2 (trainer/parallel/fsdp.py): its fp32 shards are the masters. (ZeRO-2's estimate keeps the
    # seed's whole bf16 weights: FSDP2 holds them gathered from forward to backward.)
    fsdp = par.zero == 3 and par.dp_shard > 1
    per_param = f.state_bytes_per_param(train.precision, train.fp32_grad_accum, train.optimizer, fsdp=fsdp)
    act_bytes = 4 if train.precision == "fp32" else 2  # fp8: torchao saves bf16 inputs for the backward
    # On the wire: weights in the compute dtype, gradients too unless reduced in fp32 (fp32_grad_accum).
    wire_grad = 4 if (train.fp32_grad_accum or train.precision == "fp32") else 2
    recompute = recompute_mode(cfg)

    p, v, tp, cp, ep, dp = par.pp, par.pp_virtual_stages, par.tp, par.cp, par.ep, par.dp
    mbs, seq = train.micro_batch_size, train.seq_len
    s_local = seq // cp
    micro_batches = cfg.grad_accum_steps
    chunks = chunk_layers(cfg)
    n_chunks = len(chunks)
    timeline, schedule, note = _pipeline(cfg, micro_batches)
    v_sim = v if schedule == "interleaved_1f1b" else 1

    def layer_act(i: int, mode: str) -> float:
        moe = model.moe
        is_moe = moe is not None and i % moe.every == moe.every - 1
        return f.activation_bytes_per_layer(
            s_local, mbs, model.dim, model.n_heads, tp=tp, sequence_parallel=par.sequence_parallel,
            flash_attention=est.flash_attention, recompute=mode, act_bytes=act_bytes,
            moe_top_k=moe.top_k if is_moe else 0)

    # Sharding degrees: dense state over dp x cp ranks (dp_shard x cp under ZeRO 2/3), experts over the
    # ranks that hold the same experts.
    dense_shard = (dp if par.zero < 2 else par.dp_shard) * cp
    expert_shard = max(1, (dp * cp) // ep // (par.dp_replicate if par.zero >= 2 else 1))
    last = n_chunks - 1

    stages = []
    for r in range(p):
        own = [c for c in range(n_chunks) if c % p == r]
        ids = [i for c in own for i in chunks[c]]
        routed = sum(layers[i]["routed"] for i in ids)
        dense = sum(layers[i]["total"] - layers[i]["routed"] for i in ids)
        holds_embedding, holds_head = 0 in own, last in own
        if holds_embedding:
            dense += counts["embedding"]
        if holds_head:
            dense += model.dim + counts["head"]  # final norm and LM head
            dense += mtp["total"] - mtp["routed"]  # MTP modules sit with the head (pp > 1 is refused with them)
            routed += mtp["routed"]
            if model.tie_embeddings and p > 1:
                dense += counts["embedding"]  # a tied head on its own stage keeps a copy of the table
        # Tensor parallelism splits every matrix but the norm gains and MoE layers (router, shared expert);
        # routed experts are split over ep only.
        whole = sum(layers[i]["tp_whole"] for i in ids) + ((model.dim + mtp["tp_whole"]) if holds_head else 0)
        dense_rank, routed_rank = (dense - whole) / tp + whole, routed / ep
        state = {k: a + b for (k, a), b in zip(
            f.zero_state_bytes(dense_rank, per_param, par.zero, dense_shard).items(),
            f.zero_state_bytes(routed_rank, per_param, par.zero, expert_shard).values())}
        by_zero = {}
        for z in (0, 1, 2, 3):
            replicas = par.dp_replicate if z >= 2 else 1  # HSDP replicates only sharded (ZeRO 2/3) state
            zs, es = dp // replicas * cp, max(1, dp * cp // ep // replicas)
            pz = f.state_bytes_per_param(train.precision, train.fp32_grad_accum, train.optimizer, fsdp=z == 3)
            by_zero[str(z)] = (sum(f.zero_state_bytes(dense_rank, pz, z, zs).values())
                               + sum(f.zero_state_bytes(routed_rank, pz, z, es).values()))
        chunk_bytes = [sum(layer_act(i, recompute) for i in chunks[c]) for c in range(n_chunks)]
        # MTP: one more block per depth on the last chunk, never recomputed (activation checkpointing
        # wraps the trunk's blocks), plus the 2h-wide projection input
        chunk_bytes[last] += model.mtp_depth * (layer_act(model.n_layers - 1, "none")
                                                + 2 * s_local * mbs * model.dim * act_bytes)
        if timeline is not None:
            activations = timeline.peak_held(r, chunk_bytes)
            in_flight = timeline.peak_held(r, [1.0] * n_chunks)
        else:  # Korthikanti: the first rank holds p*v + p - 1 chunks of an interleaved schedule
            in_flight = min(micro_batches * v, (p - r - 1) * 2 + (v - 1) * p + 1)
            activations = in_flight * sum(chunk_bytes[c] for c in own) / len(own)
        working = max((layer_act(i, "none") for i in ids), default=0.0) if recompute == "full" else 0.0
        logits = f.logits_bytes(s_local, mbs, model.vocab_size, tp) if holds_head else 0.0
        breakdown = {**state, "activations": activations, "recompute_working": working, "logits": logits}
        stages.append({
            "pp_rank": r, "chunks": own, "layers": ids, "holds_embedding": holds_embedding, "holds_head": holds_head,
            "params": dense_rank + routed_rank, "dense_params": dense_rank, "expert_params": routed_rank,
            "micro_batches_in_flight": in_flight / len(own), "bytes": breakdown, "total_bytes": sum(breakdown.values()),
            "state_bytes_by_zero": by_zero,
        })
    busiest = max(stages, key=lambda x: x["total_bytes"])

    # FLOPs and time (seed: 6 x params x tokens, less the embedding, plus attention).
    tokens = train.global_batch_size * seq
    q_dim = model.n_heads * model.head_size
    causal = est.attention_flops == "causal"
    per_token = f.flops_per_token(counts["active"], counts["embedding"], model.tie_embeddings, model.n_layers, seq,
                                  q_dim, causal) + f.mtp_flops_per_token(model, seq, causal)
    flops_step = per_token * tokens
    gpus = est.gpus or par.world_size
    sustained = est.gpu_peak_flops * est.mfu
    step_time = flops_step / (gpus * sustained)

    # Collectives: bytes one rank sends per step, on the rank that sends most.
    act_tensor = mbs * s_local * model.dim * act_bytes  # one [b, s, h] activation
    weight_bytes = act_bytes

    # FSDP (ZeRO 2/3) reduce-scatters every micro-batch's gradients, except inside a pipeline schedule,
    # which holds them to the stage's last micro-batch (trainer/parallel/fsdp.py, pipeline.py).
    reductions = micro_batches if par.zero >= 2 and p == 1 else 1

    def comm(st: dict) -> dict[str, float]:
        n_layers = len(st["layers"])
        moe_layers = sum(1 for i in st["layers"] if layers[i]["routed"])
        dp_bytes = f.data_parallel_bytes(st["dense_params"], par.zero, dense_shard, grad_bytes=wire_grad,
                                         weight_bytes=weight_bytes, micro_batches=micro_batches,
                                         replicate=par.dp_replicate if par.zero >= 2 else 1, reductions=reductions)
        dp_bytes += f.data_parallel_bytes(st["expert_params"], par.zero, expert_shard, grad_bytes=wire_grad,
                                          weight_bytes=weight_bytes, micro_batches=micro_batches, reductions=reductions)
        gains = 2 * n_layers * model.dim + (model.dim if st["holds_head"] else 0)
        tp_bytes = f.tensor_parallel_bytes(
            # MTP depths counted as blocks (their projection's and extra lookup's all-reduces left out)
            act_tensor, tp, dense_layers=n_layers - moe_layers + (model.mtp_depth if st["holds_head"] else 0),
            moe_layers=moe_layers,
            holds_embedding=st["holds_embedding"], holds_head=st["holds_head"], tokens=mbs * s_local,
            sequence_parallel=par.sequence_parallel, norm_gains=gains, gain_bytes=act_bytes,
            micro_batches=micro_batches)
        boundary = act_tensor / (tp if par.sequence_parallel else 1)
        sends = sum((c < last) + (c > 0) for c in st["chunks"])  # activation forward, its gradient back
        pp_bytes = micro_batches * boundary * sends if p > 1 else 0.0
        kv_local = max(model.kv_heads // tp, 1) * model.head_size
        if cp > 1 and par.cp_impl == "ring":
            # Ring attention (context_parallel.py): c - 1 hops of the K/V block (KV heads, activation dtype)
            # forward and again backward, plus c hops of their fp32 gradient accumulators (the last one home).
            block = 2 * mbs * s_local * kv_local * act_bytes
            grad_block = 2 * mbs * s_local * kv_local * 4
            cp_bytes = (2 * (cp - 1) * block + cp * grad_block) * n_layers * micro_batches
        elif cp > 1:
            # Ulysses: all-to-alls of q, k, v and the output forward, and of their gradients backward.
            q_local = (model.n_heads // tp) * model.head_size
            moved = mbs * s_local * (2 * q_local + 2 * kv_local) * act_bytes
            cp_bytes = 2 * moved * (cp - 1) / cp * n_layers * micro_batches
        else:
            cp_bytes = 0.0
        ep_bytes = 0.0
        if ep > 1 and model.moe is not None:
            # Dispatch and combine forward, and both again backward, (ep-1)/ep of the rows leaving the rank:
            # padded to capacity, every expert's `capacity` rows (exact, whatever the routing); otherwise each
            # token's top_k copies of h under balanced routing (a real router's share moves with its imbalance).
            moe, tokens_local = model.moe, mbs * s_local
            rows = (moe.num_experts * f.expert_capacity(moe.capacity_factor, tokens_local, moe.top_k, moe.num_experts)
                    if moe.pad_to_capacity else tokens_local * moe.top_k)
            ep_bytes = 4 * rows * model.dim * act_bytes * (ep - 1) / ep * moe_layers * micro_batches
        # HSDP's share of dp_bytes: the gradient shard all-reduced across replicas (its own group and link).
        hsdp = (reductions * f.hsdp_allreduce_bytes(st["dense_params"], wire_grad, dense_shard, par.dp_replicate)
                if par.zero >= 2 else 0.0)
        return {"dp": dp_bytes, "tp": tp_bytes, "pp": pp_bytes, "cp": cp_bytes, "ep": ep_bytes, "hsdp": hsdp}

    per_rank_comm = [comm(st) for st in stages]
    for st, c in zip(stages, per_rank_comm):
        st["comm_bytes"] = c  # what one rank of this pipeline stage sends per step, by dimension
    comm_bytes = {k: max(c[k] for c in per_rank_comm) for k in per_rank_comm[0]}

    # Seconds on the link each dimension's groups use (seed: NVLink ~450 GB/s each way inside a node,
    # ~50 GB/s per GPU across nodes). Data parallelism syncs over dp x cp ranks (ZeRO 0/1); under HSDP the
    # reduce-scatter/all-gather run in the shard group and the replica all-reduce in the replicate group.
    links = group_links(par)

    def seconds(nbytes: float, dim: str) -> float:
        return link_time(nbytes, links[dim]["link"], est.intra_node_bandwidth, est.inter_node_bandwidth)

    hsdp = comm_bytes.pop("hsdp")
    if par.zero >= 2:
        dp_time = seconds(comm_bytes["dp"] - hsdp, "dp_shard") + seconds(hsdp, "dp_replicate")
    else:
        dp_time = seconds(comm_bytes["dp"], "dp_cp")
    comm_time = {"dp": dp_time, **{k: seconds(comm_bytes[k], k) for k in ("tp", "pp", "cp", "ep")}}
    warnings = placement_warnings(par, links)
    rule = pipeline_warning(par.pp_schedule, p, micro_batches)
    if rule:
        warnings.append(rule)
    serve = estimate_serving(cfg)

    bubble = bubble_fraction(p, micro_batches, v_sim) if p > 1 else 0.0
    def dense_layer(flash: bool, mode: str) -> float:
        return f.activation_bytes_per_layer(s_local, mbs, model.dim, model.n_heads, tp=tp,
                                            sequence_parallel=par.sequence_parallel, flash_attention=flash,
                                            recompute=mode, act_bytes=act_bytes)

    layer_modes = {"no_flash": dense_layer(False, "none"), "flash": dense_layer(True, "none"),
                   "full_recompute": dense_layer(True, "full")}

    out = {
        "config": cfg.name,
        "params": counts["total"],
        "active_params": counts["active"],
        "embedding_params": counts["embedding"],
        "state_bytes_per_param": sum(per_param.values()),
        "state_bytes_per_param_breakdown": per_param,
        "state_bytes": counts["total"] * sum(per_param.values()),
        "state_bytes_per_rank": sum(busiest["bytes"][k] for k in ("weights", "grads", "optimizer")),
        "state_bytes_per_rank_by_zero": busiest["state_bytes_by_zero"],
        "zero": par.zero,
        "activation_recompute": recompute,
        "flash_attention": est.flash_attention,
        "activation_bytes_per_layer": layer_act(0, recompute),
        "activation_bytes_per_layer_by_mode": layer_modes,
        "busiest_pp_rank": busiest["pp_rank"],
        "busiest_rank_bytes": busiest["total_bytes"],
        "busiest_rank_breakdown": busiest["bytes"],
        "gpu_memory_bytes": est.gpu_memory_bytes,
        "fits": busiest["total_bytes"] <= est.gpu_memory_bytes,
        "stages": stages,
        "micro_batches": micro_batches,
        "tokens_per_step": tokens,
        "flops_per_token": per_token,
        "flops_per_step": flops_step,
        "attention_flops_per_step": f.attention_flops_per_token(model.n_layers, seq, q_dim, causal) * tokens,
        "embedding_flops_excluded_per_step": 0 if model.tie_embeddings else 6 * counts["embedding"] * tokens,
        "attention_flops_convention": est.attention_flops,
        "gpus": gpus,
        "gpu_peak_flops": est.gpu_peak_flops,
        "mfu": est.mfu,
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "tp_allreduce_bytes": act_tensor if tp > 1 else 0,
        "tp_allreduce_tensor_bytes": act_tensor,
        "pp_boundary_bytes": act_tensor / (tp if par.sequence_parallel else 1) if p > 1 else 0,
        "comm_bytes_per_step": comm_bytes,
        "comm_time_s_per_step": comm_time,
        "comm_links": {k: links[k] for k in ("dp_cp" if par.zero < 2 else "dp_shard", "dp_replicate", "tp", "pp",
                                             "cp", "ep")},
        "link_bandwidth": {"nvlink": est.intra_node_bandwidth, "network": est.inter_node_bandwidth},
        "warnings": warnings,
        "pipeline_schedule": par.pp_schedule,
        "pipeline_schedule_simulated": schedule if p > 1 else "none",
        "pipeline_note": note,
        "bubble_fraction": bubble,
        "bubble_fraction_timeline": (timeline.bubble_fraction if p > 1 else 0.0) if timeline is not None else None,
        "kv_bytes_per_token": f.kv_bytes_per_token(model.n_layers, model.kv_heads, model.head_size, 2),
        "serve": serve,
        "serve_max_concurrency": serve["max_concurrency"],
        "serve_ttft_s": serve["ttft_s"],
        "serve_tpot_s": serve["tpot_s"],
        "serve_peak_tokens_per_s": serve["peak_tokens_per_s"],
        "run": None,
    }
    if est.total_tokens:
        run_flops = 6 * counts["active"] * est.total_tokens  # the seed's rule: 6 x params x tokens
        gpu_seconds = run_flops / sustained
        out["run"] = {
            "total_tokens": est.total_tokens,
            "flops": run_flops,
            "flops_with_attention": per_token * est.total_tokens,
            "gpu_years": gpu_seconds / f.YEAR_S,
            "days": gpu_seconds / gpus / 86400,
        }
    return out


# What the trainer logs next to its measurements (MLflow params), so a run's measured FLOPs per step,
# tokens/s and peak memory sit beside what the formulas predicted for the same config.
TRACKED = ("params", "active_params", "flops_per_token", "flops_per_step", "step_time_s", "tokens_per_s",
           "busiest_rank_bytes", "state_bytes_per_rank", "bubble_fraction", "kv_bytes_per_token",
           "serve_max_concurrency", "serve_ttft_s", "serve_tpot_s", "serve_peak_tokens_per_s")


def tracking_params(est: dict) -> dict[str, float]:
    """`estimate.<key>` -> number for the figures in TRACKED (flat, for MLflow's log_params/log_metrics)."""
    return {f"estimate.{k}": float(est[k]) for k in TRACKED}
