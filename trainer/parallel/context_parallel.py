"""Context parallel: the sequence of every micro-batch is split over the cp ranks (seed: "context
parallelism splits the sequence itself"). Everything outside attention is per token and needs no
communication; attention needs every earlier key, so either the keys travel (ring attention) or the
heads do (DeepSpeed-Ulysses). Our own implementation: torch's `context_parallel` has no CPU kernels.

Zigzag split (Brandon et al. 2023, "Striped/zigzag" load balancing for causal ring attention): the
sequence is cut into 2c chunks and rank i holds chunks i and 2c-1-i, so every rank holds one early
and one late chunk and computes the same number of (query chunk, key chunk) tiles under the causal
mask. Positions follow the split (RoPE sees the tokens' true positions).

Ring attention (Liu et al. 2023): each rank keeps its queries; K/V blocks travel the ring by
send/recv, one hop per step, overlapped with the tile computations. Partial results of the tiles are
merged exactly with the online-softmax rule (FlashAttention): for two partial outputs o1, o2 with
log-sum-exps l1, l2, l = log(e^l1 + e^l2) and o = o1 e^(l1-l) + o2 e^(l2-l). The backward pass is a
second ring: K, V travel again, and behind them their gradient accumulators dK, dV, one hop more to
reach their owner. K/V travel as the model's KV heads (each query head group meets its KV head on
arrival, never expanded), in the compute dtype: a hop is 2 x kv_heads x head_dim x local_seq x batch
elements. As in FlashAttention, the matmuls run in the compute dtype (bf16 under autocast or with a
bf16 model), forward and backward alike, while scores, softmax statistics and accumulators are fp32.

Ulysses (Jacobs et al. 2023): an all-to-all turns sequence-sharded q/k/v into head-sharded full
sequences, plain causal attention runs per head group, and a second all-to-all turns the result
back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..data import MicroBatch
from ..model.transformer import compute_dtype
from .mesh import ParallelDims, data_context_group

# ------------------------------------------------------------------------------------- zigzag layout


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk ids (of 2*cp) that rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [seq_len / cp] of the tokens rank `rank` holds, in its local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len={seq_len} must be divisible by 2*cp={2 * cp} for the zigzag split")
    c = seq_len // (2 * cp)
    a, b = zigzag_chunks(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def zigzag_shard(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's zigzag share of a full-sequence tensor along `dim`."""
    idx = zigzag_positions(t.shape[dim], cp, rank, device=t.device)
    return t.index_select(dim, idx)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of zigzag_shard: every rank's share (in rank order) -> the full sequence."""
    cp = len(shards)
    full_len = sum(s.shape[dim] for s in shards)
    order = torch.cat([zigzag_positions(full_len, cp, r) for r in range(cp)])
    out = torch.cat(shards, dim=dim)
    return out.index_select(dim, torch.argsort(order).to(out.device))


def shard_micro_batch(mb: MicroBatch, cp: int, rank: int) -> MicroBatch:
    """Inputs and targets cut the same way: target t stays beside input t."""
    return MicroBatch(inputs=zigzag_shard(mb.inputs, cp, rank), targets=zigzag_shard(mb.targets, cp, rank), rows=mb.rows)


def tile_counts(cp: int, layout: str = "zigzag") -> list[int]:
    """(query chunk, key chunk) tiles each rank must compute under the causal mask, with the sequence
    in 2*cp chunks: a tile is needed when the query chunk is not before the key chunk (the diagonal
    tile is half masked but still computed). `naive` gives rank i chunks 2i and 2i+1."""
    held = {r: (zigzag_chunks(cp, r) if layout == "zigzag" else (2 * r, 2 * r + 1)) for r in range(cp)}
    if layout not in ("zigzag", "naive"):
        raise ValueError(f"layout={layout!r}; expected zigzag or naive")
    return [sum(1 for a in held[r] for src in range(cp) for b in held[src] if a >= b) for r in range(cp)]


# ------------------------------------------------------------------------------------- ring attention


def _matmul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b in the matmul dtype: both inputs rounded to `dtype`, the products summed and returned in
    fp32 (a bf16 GEMM with an fp32 accumulator, as tensor cores and FlashAttention run it). The forward
    and the backward both multiply through here, so the backward differentiates the forward that ran.
    A bf16 value is exact in fp32, so the fp32 matmul of the rounded inputs has the same products."""
    if dtype != torch.float32:
        a, b = a.to(dtype).float(), b.to(dtype).float()
    return torch.matmul(a, b)


def _grouped_chunks(x: torch.Tensor, kv_heads: int) -> list[torch.Tensor]:
    """[B, H, S, ...] -> the two zigzag chunks, each [B, K, g*c, ...] with the g = H/K query heads of
    one KV head stacked along the rows (HF's repeat_kv order), so that a tile against a [B, K, c, d]
    K/V block is one batched matmul and K/V are never expanded to H heads."""
    B, H, S, *rest = x.shape
    g = H // kv_heads
    return [t.reshape(B, kv_heads, g * (S // 2), *rest) for t in x.view(B, kv_heads, g, S, *rest).chunk(2, dim=3)]


def _ungrouped(chunks: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Inverse of _grouped_chunks: two [B, K, g*c, ...] -> [B, H, 2c, ...]."""
    B, K, gc, *rest = chunks[0].shape
    g = heads // K
    x = torch.cat([t.view(B, K, g, gc // g, *rest) for t in chunks], dim=3)
    return x.view(B, heads, 2 * (gc // g), *rest)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool, dtype: torch.dtype) -> torch.Tensor:
    """Scaled fp32 scores of one tile [B, K, g*c, c] (q [B, K, g*c, d], k [B, K, c, d]); the diagonal
    tile causally masked (row r is position r mod c of its chunk)."""
    s = _matmul(q, k.transpose(-1, -2), dtype) * scale
    if diagonal:
        c = s.shape[-1]
        future = torch.ones(c, c, dtype=torch.bool, device=s.device).triu(1).repeat(s.shape[-2] // c, 1)
        s = s.masked_fill(future, float("-inf"))
    return s


class _Ring:
    """Send `buf` to the next rank of the ring while receiving the previous rank's."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, buf: torch.Tensor) -> tuple[list, torch.Tensor]:
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf.contiguous(), self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops), recv


def _wait(pending):
    works, recv = pending
    for w in works:
        w.wait()
    return recv


class RingAttentionFunction(torch.autograd.Function):
    """Causal attention over the zigzag-sharded sequence. q [B, H, S_local, d], k, v [B, K, S_local, d]
    (K KV heads, each shared by H/K query heads); returns [B, H, S_local, d] in q's dtype. `stats` (a
    dict) counts the tiles computed.

    Precision (FlashAttention's): the matmuls run in the compute dtype (autocast's when it is on, else
    q's: bf16 for a bf16 model), forward and backward alike; scores, the online softmax's log-sum-exps,
    the output accumulator and the gradient accumulators are fp32. K/V travel as K heads in the compute
    dtype; the travelling dK/dV accumulators in fp32 (summed over cp hops, as torch's context_parallel
    does by default)."""

    @staticmethod
    def forward(ctx, q, k, v, group, stats):
        ring = _Ring(group)
        cp, r = ring.size, ring.rank
        dtype = compute_dtype(q)
        scale = 1.0 / math.sqrt(q.shape[-1])
        K = k.shape[1]
        with torch.autocast(q.device.type, enabled=False):  # the dtypes below are chosen, not autocast's
            kv = torch.stack([k.to(dtype), v.to(dtype)])  # travels the ring as one buffer: [2, B, K, S, d]
            qs = _grouped_chunks(q.to(dtype), K)
            own = zigzag_chunks(cp, r)
            outs = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in qs]
            lses = [torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device) for x in qs]
            held_kv, tiles = kv, 0
            for step in range(cp):
                pending = ring.start(held_kv) if step < cp - 1 else None  # the next hop overlaps these tiles
                held = zigzag_chunks(cp, (r - step) % cp)
                ks, vs = held_kv[0].chunk(2, dim=2), held_kv[1].chunk(2, dim=2)
                for a in range(2):
                    for b in range(2):
                        if own[a] < held[b]:
                            continue  # wholly in the causal mask's future: not computed
                        s = _scores(qs[a], ks[b], scale, own[a] == held[b], dtype)
                        lse_t = torch.logsumexp(s, dim=-1)
                        o_t = _matmul(torch.exp(s - lse_t[..., None]), vs[b], dtype)
                        lse = torch.logaddexp(lses[a], lse_t)  # the online-softmax merge, in fp32
                        outs[a] = (outs[a] * torch.exp(lses[a] - lse)[..., None]
                                   + o_t * torch.exp(lse_t - lse)[..., None])
                        lses[a] = lse
                        tiles += 1
                if pending is not None:
                    held_kv = _wait(pending)
        if stats is not None:
            stats["tiles"] = stats.get("tiles", 0) + tiles
        out = _ungrouped(outs, q.shape[1])
        ctx.save_for_backward(q.to(dtype), kv, out, _ungrouped(lses, q.shape[1]))
        ctx.group, ctx.dtype, ctx.in_dtypes = group, dtype, (q.dtype, k.dtype, v.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, kv, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, r = ring.size, ring.rank
        dtype, K = ctx.dtype, kv.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        with torch.autocast(q.device.type, enabled=False):
            d_out = d_out.to(dtype).float()  # dO enters the matmuls in the matmul dtype, so D must see the same
            delta = (d_out * out).sum(dim=-1)  # D_i = sum_j dO_ij O_ij (FlashAttention backward), fp32
            qs, dos = _grouped_chunks(q, K), _grouped_chunks(d_out, K)
            lses, deltas = _grouped_chunks(lse, K), _grouped_chunks(delta, K)
            own = zigzag_chunks(cp, r)
            dqs = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in qs]
            held_kv = kv
            # dK, dV of the block held: fp32, they travel with it and reach their owner after cp hops.
            acc = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for step in range(cp):
                pending = ring.start(held_kv) if step < cp - 1 else None
                held = zigzag_chunks(cp, (r - step) % cp)
                ks, vs = held_kv[0].chunk(2, dim=2), held_kv[1].chunk(2, dim=2)
                dks, dvs = acc[0].chunk(2, dim=2), acc[1].chunk(2, dim=2)  # views: accumulate in place
                for a in range(2):
                    for b in range(2):
                        if own[a] < held[b]:
                            continue
                        p = torch.exp(_scores(qs[a], ks[b], scale, own[a] == held[b], dtype) - lses[a][..., None])
                        dvs[b].add_(_matmul(p.transpose(-1, -2), dos[a], dtype))
                        dp = _matmul(dos[a], vs[b].transpose(-1, -2), dtype)
                        ds = p * (dp - deltas[a][..., None])
                        dqs[a].add_(_matmul(ds, ks[b], dtype) * scale)
                        dks[b].add_(_matmul(ds.transpose(-1, -2), qs[a], dtype) * scale)
                acc = _wait(ring.start(acc))
                if pending is not None:
                    held_kv = _wait(pending)
        dq = _ungrouped(dqs, q.shape[1])
        q_dtype, k_dtype, v_dtype = ctx.in_dtypes
        return dq.to(q_dtype), acc[0].to(k_dtype), acc[1].to(v_dtype), None, None


class RingAttention:
    """A drop-in `Attention.attention_fn` for zigzag-sharded sequences."""

    def __init__(self, group):
        self.group = group
        self.stats: dict[str, int] = {}

    def __call__(self, q, k, v):
        return RingAttentionFunction.apply(q, k, v, self.group, self.stats)

    def __deepcopy__(self, memo):  # process groups cannot be copied; the copy shares the group
        return RingAttention(self.group)


# ------------------------------------------------------------------------------------------ Ulysses


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 with autograd (the backward is the reverse all-to-all)."""
    from torch.distributed.nn.functional import all_to_all_single

    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # the collective writes it flat
    return all_to_all_single(out, x, group=group)


class UlyssesAttention:
    """Sequence-sharded in, head-sharded attention, sequence-sharded out (two all-to-alls each way)."""

    def __init__(self, group):
        self.group = group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, S_local, d] -> [B, N/cp, S, d] with the sequence back in natural order."""
        B, N, S_l, d = x.shape
        if N % self.cp:
            raise ValueError(f"Ulysses: {N} heads are not divisible by cp={self.cp}")
        x = x.view(B, self.cp, N // self.cp, S_l, d).transpose(0, 1)  # [cp(dest), B, N/cp, S_l, d]
        x = _all_to_all(x, self.group)  # [cp(src), B, N/cp, S_l, d]
        x = x.permute(1, 2, 0, 3, 4).reshape(B, N // self.cp, self.cp * S_l, d)  # zigzag order
        return x.index_select(2, self._natural_order(self.cp * S_l, x.device))

    def _to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """[B, H/cp, S, d] in natural order -> [B, H, S_local, d] of this rank's zigzag share."""
        B, Hc, S, d = y.shape
        zig = torch.cat([zigzag_positions(S, self.cp, r, device=y.device) for r in range(self.cp)])
        y = y.index_select(2, zig).view(B, Hc, self.cp, S // self.cp, d).permute(2, 0, 1, 3, 4)  # [cp(dest), ...]
        y = _all_to_all(y, self.group)  # [cp(src = head group), B, H/cp, S_l, d]
        return y.transpose(0, 1).reshape(B, self.cp * Hc, S // self.cp, d)

    def _natural_order(self, S: int, device) -> torch.Tensor:
        zig = torch.cat([zigzag_positions(S, self.cp, r, device=device) for r in range(self.cp)])
        return torch.argsort(zig)

    def __call__(self, q, k, v):
        if k.shape[1] % self.cp:  # refused before anything starts (infra.config.parallel.unsupported_layout)
            raise ValueError(f"Ulysses splits the {k.shape[1]} KV heads over cp={self.cp} ranks; they do not divide")
        y = F.scaled_dot_product_attention(self._to_heads(q), self._to_heads(k), self._to_heads(v), is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self._to_sequence(y)

    def __deepcopy__(self, memo):
        return UlyssesAttention(self.group)


# ------------------------------------------------------------------------------------ applying it


def _zigzag_positions_hook(cp: int, rank: int):
    def hook(module, args, kwargs):
        if kwargs.get("positions") is None and (len(args) < 2 or args[1] is None):
            x = args[0] if args else kwargs["tokens"]
            # A later pipeline stage under sequence parallel receives 1/tp of this rank's tokens.
            local = x.shape[1] * getattr(module, "sequence_shards", 1)
            kwargs = {**kwargs, "positions": zigzag_positions(local * cp, cp, rank, device=x.device)}
        return args, kwargs

    return hook


def apply_context_parallel(model: nn.Module, group, impl: str, hook_targets: list[nn.Module] | None = None) -> None:
    """Swap every attention's score step for ring or Ulysses attention over `group`, and make the
    forward of `hook_targets` (the model, or its pipeline stages) see the tokens' true (zigzag) positions."""
    from ..model.transformer import Attention

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if impl not in ("ring", "ulysses"):
        raise ValueError(f"parallel.cp_impl={impl!r}; expected ring or ulysses")
    for m in model.modules():
        if isinstance(m, Attention):
            if impl == "ulysses" and m.n_kv_heads % cp:
                raise ValueError(f"Ulysses needs model.n_kv_heads={m.n_kv_heads} divisible by parallel.cp={cp}")
            m.attention_fn = RingAttention(group) if impl == "ring" else UlyssesAttention(group)
    for target in hook_targets if hook_targets is not None else [model]:
        target.register_forward_pre_hook(_zigzag_positions_hook(cp, rank), with_kwargs=True)


def ring_tiles_computed(model: nn.Module) -> int:
    """Tiles the model's ring attentions computed so far (forward passes only)."""
    from ..model.transformer import Attention

    return sum(m.attention_fn.stats.get("tiles", 0) for m in model.modules()
               if isinstance(m, Attention) and isinstance(m.attention_fn, RingAttention))


class ContextParallelObjective:
    """Wraps an objective: every micro-batch is cut to this rank's zigzag share before the loss, so
    weights (token counts) and losses are this rank's part of the sequence; summed over the dp x cp
    group they are the global batch's."""

    def __init__(self, inner, cp: int, rank: int):
        self.inner, self.cp, self.rank = inner, cp, rank

    def shard(self, batch: MicroBatch) -> MicroBatch:
        return shard_micro_batch(batch, self.cp, self.rank)

    def weight(self, batch: MicroBatch) -> int:
        return self.inner.weight(self.shard(batch))

    def loss(self, model, batch: MicroBatch, device):
        return self.inner.loss(model, shard_micro_batch(batch, self.cp, self.rank), device)

    def __getattr__(self, name):  # z_loss and friends
        return getattr(self.inner, name)


def context_parallel_setup(dims: ParallelDims, objective):
    """For the loop: the group gradients and token counts are summed over (dp x cp), and the
    objective that cuts each micro-batch to this rank's share."""
    return data_context_group(dims), ContextParallelObjective(objective, dims.cp, dims.rank("cp"))
