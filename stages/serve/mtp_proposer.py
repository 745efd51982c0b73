"""Speculative drafts from the model's own multi-token-prediction modules (DeepSeek-V3 section 2.2;
trainer/model/mtp.py; weights from the export's `mtp.safetensors` sidecar, stages/export/hf.py).

Depth k at position j combines h^{k-1}_j (h^0: the target's last layer output before its final norm)
with the embedding of token t_{j+k} and predicts t_{j+k+1}. With the target's tokens confirmed up to
t_n (position n not yet run by the target), depth 1 at position n-1 proposes t_{n+1}, depth 2 at n-1
(fed that draft) t_{n+2}, and so on: k <= D drafts, one MTP block pass each.

Each depth's block attends over its own earlier positions, so it keeps paged K/V like the target's, in
the target's block ids (KVCacheTensors with one layer per depth). The target's h^0 is written per KV
slot during its forward (PagedLlama.hidden_cache), the depths' h^k likewise here, so nothing depends on
how the runner ordered its rows. Per request, depth k's positions below `mtp_computed[k]` are final
(their inputs are confirmed tokens); later ones are recomputed each round, which also overwrites
what a rejected draft left behind. Drafts are verified by the same exact rejection sampling as the
other proposers (speculative.py), so output is unchanged whatever they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import attend, build_attention_metadata
from .layer_pass import LayerPass, _rms_norm
from .model import KVCacheTensors, PagedLlama
from .request import Request
from .speculative import _budget, draft_token


def mtp_layer_weights(sd: dict[str, torch.Tensor], depth: int, model: PagedLlama) -> dict:
    """Depth `depth`'s tensors (ours, from the sidecar) in the serving layout (q/k/v and gate/up fused)."""
    p = f"mtp.{depth - 1}."
    dev, dt = model.device, model.dtype

    def get(name: str) -> torch.Tensor:
        if p + name not in sd:
            raise KeyError(f"MTP sidecar has no tensor {p + name!r}")
        return sd[p + name].to(device=dev, dtype=dt).contiguous()

    if p + "block.mlp.gate_proj.weight" not in sd:
        raise ValueError(f"MTP depth {depth}: only dense (SwiGLU) MTP blocks are served; this one has none")
    opt = lambda n: get(n) if p + n in sd else None  # noqa: E731
    return {
        "hnorm": get("hnorm.weight"), "enorm": get("enorm.weight"), "eh_proj": get("eh_proj.weight"),
        "norm": get("norm.weight"),
        "w_in": (get("block.input_layernorm.weight"),
                 torch.cat([get(f"block.self_attn.{n}_proj.weight") for n in "qkv"]).contiguous(), None,
                 opt("block.self_attn.q_norm.weight"), opt("block.self_attn.k_norm.weight")),
        "w_out": (get("block.self_attn.o_proj.weight"), get("block.post_attention_layernorm.weight"),
                  torch.cat([get("block.mlp.gate_proj.weight"), get("block.mlp.up_proj.weight")]).contiguous(),
                  get("block.mlp.down_proj.weight")),
    }


class MTPProposer:
    """Proposes k <= D tokens per decoding request from the target's MTP modules (module docstring)."""

    def __init__(self, model: PagedLlama, mtp_state: dict[str, torch.Tensor], depth: int, k: int,
                 num_blocks: int, block_size: int, max_model_len: int):
        if not 1 <= k <= depth:
            raise ValueError(f"MTP drafts k={k} tokens, the checkpoint has depth {depth}: need 1 <= k <= depth")
        self.model, self.k, self.max_model_len = model, k, max_model_len
        self.depths = [mtp_layer_weights(mtp_state, d, model) for d in range(1, k + 1)]
        shape = model.shape
        self.cache = KVCacheTensors(_Layers(shape, k), num_blocks, block_size, model.dtype, model.device)
        slots = num_blocks * block_size
        # h^0 (written by the target's forward) and h^1..h^{k-1} (written here), per KV slot
        self.hidden = [torch.zeros(slots, shape.hidden_size, dtype=model.dtype, device=model.device)
                       for _ in range(k)]
        model.hidden_cache = self.hidden[0]
        self.block = LayerPass(shape)
        self.query_group = shape.num_heads // shape.num_kv_heads

    @torch.inference_mode()
    def propose(self, reqs: list[Request], block_ids: dict[str, list[int]]) -> None:
        todo = []
        for r in reqs:
            r.spec_token_ids, r.spec_draft_probs = [], None
            k = _budget(r, self.k, self.max_model_len)
            if r.mtp_preemptions != r.num_preemptions:  # recomputed from scratch in new blocks
                r.mtp_computed, r.mtp_preemptions = [], r.num_preemptions
            if k > 0:
                todo.append((r, k))
        if not todo:
            return
        probs: list[list[torch.Tensor]] = [[] for _ in todo]
        for depth in range(1, max(k for _, k in todo) + 1):
            active = [i for i, (_, k) in enumerate(todo) if k >= depth]
            seqs, feeds = [], []
            for i in active:
                r = todo[i][0]
                n = r.num_tokens - 1  # t_n confirmed, position n not yet run by the target
                start = min(r.mtp_computed[depth - 1] if len(r.mtp_computed) >= depth else 0, n - 1)
                known = r.token_ids + r.spec_token_ids  # t_{j+depth} for j in [start, n-1]
                seqs.append((block_ids[r.request_id], start, known[start + depth: n + depth]))
                feeds.append((r, n, start))
            logits = self._run_depth(depth, seqs)
            for row, (i, (r, n, start)) in enumerate(zip(active, feeds)):
                tok, q = draft_token(logits[row:row + 1], r)
                if q is not None:
                    probs[i].append(q)
                r.spec_token_ids.append(tok)
                while len(r.mtp_computed) < depth:
                    r.mtp_computed.append(0)
                # positions whose inputs are all confirmed tokens: j + depth <= n
                r.mtp_computed[depth - 1] = n - depth + 1
        for i, (r, _) in enumerate(todo):
            if probs[i]:
                r.spec_draft_probs = torch.stack(probs[i])

    def _run_depth(self, depth: int, seqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """Depth `depth` over each sequence's positions [start, start + len(tokens)): writes its K/V and
        h^depth, returns the float32 logits of each sequence's last position."""
        w = self.depths[depth - 1]
        model, L = self.model, depth - 1
        # attention groups want short queries first, by context length (as run_paged orders them)
        order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i][2]) > 16, seqs[i][1] + len(seqs[i][2])))
        ids: list[int] = []
        last = [0] * len(seqs)
        for i in order:
            ids.extend(seqs[i][2])
            last[i] = len(ids) - 1
        meta = build_attention_metadata([(seqs[i][0], seqs[i][1], len(seqs[i][2])) for i in order],
                                        self.cache.block_size, model.device, query_group=self.query_group,
                                        short_query=16)
        slots = meta.slot_mapping
        eps = model.shape.rms_norm_eps
        h_prev = self.hidden[L][slots]
        e = model.embed[torch.tensor(ids, dtype=torch.long, device=model.device)]
        x = F.linear(torch.cat([_rms_norm(h_prev, w["hnorm"], eps), _rms_norm(e, w["enorm"], eps)], dim=-1),
                     w["eh_proj"])
        cos = model.cos[meta.positions][:, None, :]
        sin = (model.sin if w["w_in"][3] is not None else model.sin_signed)[meta.positions][:, None, :]
        q, kv_new = self.block.attn_in(x, w["w_in"], cos, sin)
        self.cache.write_stacked(L, slots, kv_new)
        x = self.block.attn_out(x, attend(L, q, kv_new, meta.groups, self.cache), w["w_out"])
        if depth < len(self.hidden):
            self.hidden[depth][slots] = x
        rows = torch.tensor(last, dtype=torch.long, device=model.device)
        return F.linear(_rms_norm(x[rows], w["norm"], eps), model.lm_head).float()


class _Layers:
    """The target's K/V shape with one layer per MTP depth (for KVCacheTensors)."""

    def __init__(self, shape, n: int):
        self.num_kv_heads, self.head_dim, self.num_layers = shape.num_kv_heads, shape.head_dim, n
