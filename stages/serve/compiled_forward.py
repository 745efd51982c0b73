"""The model's math outside attention (norms, projections, RoPE, MLP, LM head) as plain functions
(`EagerPieces`, which model.forward calls between its attention calls), and the all-decode step
compiled with `torch.compile` (inductor), as vLLM compiles its model by default (its
`--enforce-eager` turns that off; here `EngineConfig.enforce_eager`).

What is compiled is the step that dominates serving: every running request decoding in its decode
slot (decode_slots.py), with or without draft tokens to verify, and the same step with whole
prompts of requests joining the batch prefilled alongside (at concurrency 32 about one step in six
has one; run eagerly, they took a third of the serving time). `dense_decode` runs that step whole,
all layers, the cache writes and the attention included, as one graph: one call per step instead of
~30 small ops per layer, each paying its dispatch cost (most of a step's time on a tiny model on
CPU). Its sizes (sequences, context, slot capacity, prompt rows) are read off tensor shapes, so one
graph serves them all; a lone sequence (size 1, which torch specialises), each query count (1, or
1 + k when speculating) and the joining-prompts case get their own. Other mixed steps (a chunk of a
long prompt, a prompt after a prefix-cache hit, logprobs) stay eager: compiling the pieces between
attentions one by one was measured no faster, the cost of entering each compiled call (~80 us of
guards and wrappers) eating what fusion saved.

Mixture-of-experts models stay eager (`CompiledPieces.build` says so): their expert loop sizes each
matmul from the per-expert token counts of the step (moe.py), shapes that change step by step.

The engine warms every variant up at start, so no request pays for compiling. A call that fails
to compile logs a warning, is redone eagerly (its writes are idempotent: the same K/V to the same
places) and the model runs eager from then on.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from .moe import MoEWeights, moe_mlp

log = logging.getLogger(__name__)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)  # one fused op
    # same order of operations as HF LlamaRMSNorm: normalise in float32, then scale in the weight dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class EagerPieces:
    """The pieces as plain torch (the reference the compiled ones are made from)."""

    compiled = False

    def __init__(self, shape):
        self.nh, self.kvh, self.d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.eps = shape.rms_norm_eps
        self.inter = shape.intermediate_size

    def attn_in(self, x: torch.Tensor, w: tuple, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> q [T, heads, d] with RoPE, and K/V stacked as [2, kv_heads, T, d]."""
        attn_norm, qkv_w, qkv_b, q_norm, k_norm = w
        nh, kvh, d, T = self.nh, self.kvh, self.d, x.shape[0]
        h = _rms_norm(x, attn_norm, self.eps)
        qkv = F.linear(h, qkv_w, qkv_b)
        v = qkv[:, (nh + kvh) * d:].view(T, kvh, d)
        if q_norm is None:  # RoPE on queries and keys together: one set of ops, not two (sin: sign-folded)
            qk = qkv[:, : (nh + kvh) * d].view(T, nh + kvh, d)
            qk = qk * cos + torch.roll(qk, d // 2, dims=-1) * sin
            q, k = qk[:, :nh], qk[:, nh:]
        else:
            q = _rms_norm(qkv[:, : nh * d].view(T, nh, d), q_norm, self.eps)
            k = _rms_norm(qkv[:, nh * d: (nh + kvh) * d].view(T, kvh, d), k_norm, self.eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        return q, torch.stack((k, v)).transpose(1, 2)

    def attn_out(self, x: torch.Tensor, attn: torch.Tensor, w: tuple) -> torch.Tensor:
        """The residual stream after the output projection and the MLP."""
        o, mlp_norm, gate_up, down = w
        T = x.shape[0]
        x = x + F.linear(attn.reshape(T, self.nh * self.d), o)
        h = _rms_norm(x, mlp_norm, self.eps)
        if isinstance(gate_up, MoEWeights):  # a sparse layer (moe.py): `down` is None
            return x + moe_mlp(h, gate_up)
        gu = F.linear(h, gate_up)
        return x + F.linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter:], down)

    # what the forward calls: before the first attention, between two, after the last
    def first(self, x, w_in, cos, sin):
        return self.attn_in(x, w_in, cos, sin)

    def between(self, x, attn, w_out, w_in_next, cos, sin):
        x = self.attn_out(x, attn, w_out)
        q, kv = self.attn_in(x, w_in_next, cos, sin)
        return x, q, kv

    def last(self, x, attn, w_out):
        return self.attn_out(x, attn, w_out)

    def dense_decode(self, ids, embed, cos, sin, slot_mapping, dest, mask, pool, slot_kv, weights,
                     final_norm, lm_head, lo: int, prefill_mask=None, logits_rows=None):
        """A whole all-decode step (model.forward's `whole` case: every sequence in its decode slot,
        the slots lo.. all in use, each feeding Q tokens: 1, or 1 + its draft tokens to verify),
        as one function: writes each layer's K/V to the pool and to the slots, attends over the
        slot rows, returns the logits of every row. The mask, [1, S, Q*group, context], gives the
        number of sequences and the context (sizes, not ints: they stay symbolic when compiled).

        With `prefill_mask` ([P, P], additive), the P rows after the decode rows are whole prompts
        starting at position 0 (requests joining the batch), attending among themselves: causal
        within each prompt, blocked across prompts. Their K/V go to the pool only; they take a
        decode slot when they decode. Logits are then of `logits_rows` only."""
        nh, kvh, d = self.nh, self.kvh, self.d
        group, T = nh // kvh, ids.shape[0]
        S, ctx = mask.shape[1], mask.shape[3]
        Q = mask.shape[2] // group
        n_dec = S * Q
        scale = 1.0 / math.sqrt(d)
        x = embed[ids]
        for li, (w_in, w_out) in enumerate(weights):
            q, kv_new = self.attn_in(x, w_in, cos, sin)
            pool[li][:, :, slot_mapping] = kv_new  # write first, then read (as model.forward)
            kv = slot_kv[li]
            two, _, S_all, cap, _ = kv.shape
            kv.view(two, kvh, S_all * cap, d).index_copy_(2, dest, kv_new if prefill_mask is None else kv_new[:, :, :n_dec])
            kk, vv = kv[0, :, lo:lo + S, :ctx], kv[1, :, lo:lo + S, :ctx]
            qq = q[:n_dec].reshape(S, Q, kvh, group, d).permute(2, 0, 1, 3, 4).reshape(kvh, S, Q * group, d)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
            o = o.view(kvh, S, Q, group, d).permute(1, 2, 0, 3, 4).reshape(n_dec, nh, d)
            if prefill_mask is not None:
                o = torch.cat((o, self._prefill_attention(q[n_dec:], kv_new[:, :, n_dec:], prefill_mask, scale)))
            x = self.attn_out(x, o, w_out)
        return self.head(x if logits_rows is None else x[logits_rows], final_norm, lm_head)

    def _prefill_attention(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """q [P, heads, d], kv [2, kv_heads, P, d] -> [P, heads, d]. Query head h reads KV head
        h // group (HF's repeat_kv); K/V are broadcast over the group, not copied."""
        kvh, d = self.kvh, self.d
        P, group = q.shape[0], self.nh // kvh
        qq = q.view(P, kvh, group, d).permute(1, 2, 0, 3)  # [kv_heads, group, P, d]
        k = kv[0][:, None].expand(kvh, group, P, d)
        v = kv[1][:, None].expand(kvh, group, P, d)
        o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=scale)
        return o.permute(2, 0, 1, 3).reshape(P, self.nh, d)

    def head(self, x, final_norm, lm_head):
        """Logits (float32) of the rows given."""
        return F.linear(_rms_norm(x, final_norm, self.eps), lm_head).float()


class CompiledPieces:
    """`EagerPieces` with `dense_decode` through `torch.compile`, a warm-up and an eager fallback."""

    compiled = True

    def __init__(self, model, eager: EagerPieces):
        self.model, self.eager = model, eager
        self.compile_seconds = 0.0
        self.num_calls = 0  # compiled calls made (warm-up included)
        self._fns = {name: torch.compile(getattr(eager, name)) for name in ("dense_decode",)}

    @classmethod
    def build(cls, model) -> "CompiledPieces | None":
        """None (and a warning) when the weights are not all plain tensors: quantized weights
        (quant_linear.py) dequantize through `__torch_function__`, which is not compiled here."""
        if model.shape.num_experts:
            # the expert loop sizes its matmuls from a host-side count per expert: data-dependent
            # shapes that would recompile (or break the graph) step after step
            log.warning("compiled forward skipped: mixture-of-experts layers run eager (token-grouped expert loop)")
            return None
        plain = all(isinstance(t, torch.Tensor) for li in range(len(model.layers)) for w in model.layer_weights(li)
                    for t in w if t is not None)
        if not plain or not isinstance(model.lm_head, torch.Tensor) or not isinstance(model.embed, torch.Tensor):
            log.warning("compiled forward skipped: the weights are quantized; running eager")
            return None
        return cls(model, EagerPieces(model.shape))

    def _call(self, name: str, *args):
        try:
            out = self._fns[name](*args)
            self.num_calls += 1
            return out
        except Exception as e:  # noqa: BLE001 - any compiler failure: redo eagerly (same writes, same places)
            log.warning("compiled forward failed (%s: %s); running eager from now on", type(e).__name__, e)
            self.model.pieces = self.eager
            return getattr(self.eager, name)(*args)

    # the pieces of mixed steps (prefill chunks, decodes outside slots) stay eager: compiled one by
    # one, the cost of entering each compiled call (guards, wrappers: ~80 us) ate what fusing saved
    def first(self, *args):
        return self.eager.first(*args)

    def between(self, *args):
        return self.eager.between(*args)

    def last(self, *args):
        return self.eager.last(*args)

    def dense_decode(self, *args):
        return self._call("dense_decode", *args)

    def head(self, *args):  # eager: mostly the LM head's matmul, which inductor's code ran no faster
        return self.eager.head(*args)

    def warm_up_decode(self, cache, slots, num_speculative_tokens: int = 0) -> bool:
        """Compile `dense_decode` over the engine's own pool and decode slots (nothing is allocated
        yet, so the rows and slots written are free ones): for 1 query per sequence (and 1 + k when
        speculating), one graph for any number of sequences >= 2 and any context and slot capacity,
        and one for a lone sequence (torch specialises size 1)."""
        m = self.model
        t0 = time.perf_counter()
        weights = [m.layer_weights(li) for li in range(len(m.layers))]
        slots.ensure_capacity(8)  # outside inference mode: the slots are written in place later
        variants = [(S, Q, ()) for Q in sorted({1, 1 + num_speculative_tokens}) for S in (2, 1)]
        variants.append((2, 1, (3, 2)))  # decodes with whole prompts joining (runner._execute_decodes)
        for S, Q, prompts in variants:
            self._warm_decode(cache, slots, weights, S, Q, ctx=Q + 3, prompts=prompts)
            if m.pieces is not self:
                return False
        self.compile_seconds += time.perf_counter() - t0
        return True

    def _warm_decode(self, cache, slots, weights, S: int, Q: int, ctx: int, prompts: tuple[int, ...] = ()) -> None:
        m = self.model
        s, dev = m.shape, m.device
        qk_norm = weights[0][0][3] is not None
        group = s.num_heads // s.num_kv_heads
        pos = (torch.arange(Q, device=dev) + ctx - Q).repeat(S)
        dest = torch.arange(S, device=dev).repeat_interleave(Q) * slots.capacity + pos
        prefill_mask = logits_rows = None
        if prompts:  # as decode_slots.run_decodes lays them out
            from .decode_slots import prompt_layout

            p_pos, p_mask, rows = prompt_layout(np.asarray(prompts, dtype=np.int64), S * Q)
            prefill_mask, logits_rows = torch.from_numpy(p_mask).to(dev, m.dtype), torch.from_numpy(rows).to(dev)
            pos = torch.cat((pos, torch.from_numpy(p_pos).to(dev)))
        ids = torch.zeros(pos.shape[0], dtype=torch.long, device=dev)
        # laid out as decode_slots.dense_group lays it out (strides are guarded too)
        if Q == 1:
            mask = torch.zeros(S, ctx, device=dev).to(m.dtype)[None, :, None, :].expand(1, S, group, ctx)
        else:
            mask = torch.zeros(S, Q * group, ctx, device=dev).to(m.dtype)[None]
        # made as the engine makes them: the step's index tensors outside inference mode, the RoPE
        # rows inside (model.forward), since guards tell the two kinds of tensor apart
        with torch.inference_mode():
            cos = m.cos[pos][:, None, :]
            sin = (m.sin if qk_norm else m.sin_signed)[pos][:, None, :]
            dyn = [(t, 0) for t in (ids, cos, sin, pos, dest)] + [(mask, 1)] if S > 1 else []
            if prompts:  # any number and length of prompts
                dyn += [(prefill_mask, 0), (prefill_mask, 1), (logits_rows, 0)]
            for t, dim in dyn + [(mask, 3)] + [(kv, 3) for kv in slots.kv]:  # any T, context and capacity
                torch._dynamo.mark_dynamic(t, dim)
            self.dense_decode(ids, m.embed, cos, sin, pos, dest, mask, cache.kv, slots.kv, weights,
                              m.final_norm, m.lm_head, 0, prefill_mask, logits_rows)
