"""The layer pass (layer_pass.py) compiled whole with `torch.compile` (inductor), as vLLM compiles its
model by default (its `--enforce-eager` turns that off; here `EngineConfig.enforce_eager`).

What runs compiled is the step that dominates serving: every running request decoding in its decode
slot (decode_slots.py), with or without draft tokens to verify, and the same step with whole
prompts of requests joining the batch prefilled alongside (at concurrency 32 about one step in six
has one; run eagerly, they took a third of the serving time). The whole step, all layers, the cache
writes and the attention included, is one graph: one call per step instead of ~30 small ops per
layer, each paying its dispatch cost (most of a step's time on a tiny model on CPU). Its sizes
(sequences, context, slot capacity, prompt rows) are read off tensor shapes, so one graph serves
them all; a lone sequence (size 1, which torch specialises), each query count (1, or 1 + k when
speculating) and the joining-prompts case get their own. Other steps (a chunk of a long prompt, a
prompt after a prefix-cache hit, logprobs, LoRA rows, an FP8 cache) run the same pass eagerly:
compiling the pieces between attentions one by one was measured no faster, the cost of entering
each compiled call (~80 us of guards and wrappers) eating what fusion saved. With MTP drafting
(mtp_proposer.py) the compiled step also writes each row's last hidden state, which the drafts read.

Mixture-of-experts models stay eager (`CompiledLayerPass.build` says so): their expert loop sizes
each matmul from the per-expert token counts of the step (moe.py), shapes that change step by step.

The engine warms every variant up at start, through the runtime's own step (decode_slots.run_decodes),
so no request pays for compiling. A call that fails to compile logs a warning, is redone eagerly
(its writes are idempotent: the same K/V to the same places) and the model runs eager from then on.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from .attention import AttentionMetadata
from .layer_pass import LayerPass

log = logging.getLogger(__name__)
RECOMPILE_LIMIT = 32


class CompiledLayerPass:
    """`LayerPass.run` through `torch.compile` for the warmed-up steps, with an eager fallback."""

    compiled = True

    def __init__(self, model, eager: LayerPass):
        self.model, self.eager = model, eager
        self.compile_seconds = 0.0
        # One engine compiles ~5 variants of `LayerPass.run`; engines in one process (replicas, a benchmark's
        # plain and speculative pair) share that function's cache, and past torch's limit of 8 a variant
        # would silently stay eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.num_calls = 0  # compiled calls made (warm-up included)
        self._run = torch.compile(eager.run)
        self._warming = False  # in warm_up_decode: mark the sizes that vary from step to step

    @classmethod
    def build(cls, model) -> "CompiledLayerPass | None":
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
        return cls(model, LayerPass(model.shape))

    @staticmethod
    def covers(meta: AttentionMetadata, cache, logits_rows) -> bool:
        """The steps warmed up at start: one unpadded group of decodes in their decode slots, all
        logits wanted; or that group followed by whole prompts attending among themselves."""
        g = meta.groups
        if cache.fp8 or not g or g[0].slot_kv is None or g[0].token_index is not None:
            return False
        return logits_rows is None if len(g) == 1 else len(g) == 2 and meta.prompts_join

    def run(self, ids, embed, cos, sin, weights, final_norm, lm_head, cache, meta, logits_rows,
            hidden_out=None) -> torch.Tensor:
        args = (ids, embed, cos, sin, weights, final_norm, lm_head, cache, meta, logits_rows, hidden_out)
        if self._warming:
            _mark_dynamic_sizes(ids, cos, sin, meta, logits_rows)
        try:
            out = self._run(*args)
            self.num_calls += 1
            return out
        except Exception as e:  # noqa: BLE001 - any compiler failure: redo eagerly (same writes, same places)
            log.warning("compiled forward failed (%s: %s); running eager from now on", type(e).__name__, e)
            self.model.pieces = self.eager
            return self.eager.run(*args)

    def warm_up_decode(self, cache, slots, num_speculative_tokens: int = 0) -> bool:
        """Compile the decode steps over the engine's own pool and decode slots (nothing is allocated
        yet, so the rows and slots written are free ones), each made by the step the runtime runs
        (decode_slots.run_decodes): for 1 query per sequence (and 1 + k when speculating), one graph
        for any number of sequences >= 2 and any context and slot capacity, and one for a lone
        sequence (torch specialises size 1); and decodes with whole prompts joining them."""
        from .decode_slots import run_decodes

        m = self.model
        t0 = time.perf_counter()
        variants = [(S, Q, ()) for Q in sorted({1, 1 + num_speculative_tokens}) for S in (2, 1)]
        variants.append((2, 1, (3, 2)))  # decodes with whole prompts joining (runner._execute_decodes)
        self._warming = True
        try:
            for S, Q, prompts in variants:
                ctx = Q + 3  # positions within block 0 of the pool, free at start
                rows = S * Q
                run_decodes(m, cache, slots, np.arange(S), np.full(S, ctx - Q), np.zeros(rows, dtype=np.int64),
                            [0] * rows, None if Q == 1 else np.full(S, Q),
                            prompts=[([0] * p, [0]) for p in prompts] or None)
                if m.pieces is not self:
                    return False
        finally:
            self._warming = False
        self.compile_seconds += time.perf_counter() - t0
        return True


def _mark_dynamic_sizes(ids, cos, sin, meta: AttentionMetadata, logits_rows) -> None:
    """A variant's first (compiling) call: the sizes that change from step to step become symbolic,
    so that one graph serves them all: the rows (unless a lone sequence's), the context, the slots'
    capacity and the joining prompts' rows."""
    decodes = meta.groups[0]
    dyn = [(decodes.mask, 3)] + [(kv, 3) for kv in decodes.slot_kv]
    if decodes.mask.shape[1] > 1:
        dyn += [(t, 0) for t in (ids, cos, sin, meta.slot_mapping, meta.slot_write.dest)] + [(decodes.mask, 1)]
        if decodes.key_lengths is not None:
            dyn.append((decodes.key_lengths, 0))
    if len(meta.groups) > 1:  # any number and length of prompts
        prompts = meta.groups[1].mask
        dyn += [(prompts, 2), (prompts, 3), (logits_rows, 0)]
    for t, dim in dyn:
        torch._dynamo.mark_dynamic(t, dim)
