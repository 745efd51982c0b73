"""Turns one scheduled step into one forward of the target model and the tokens it yields.

All requests of the step, whatever their phase (a prefill chunk, a decode, a decode with k draft
tokens to verify), go through a single forward; logits are computed only for the rows that need
them: the last row of a request that reaches its end, the k+1 verification rows of a speculative
request, and every row of a prompt whose logprobs were asked for. The rows of requests whose output
is constrained by a grammar are masked to it before anything samples from them
(structured_output.py).
"""

from __future__ import annotations

import numpy as np
import torch

from .decode_slots import DecodeSlots, run_decodes, run_with_slots
from .kv_cache import KVCacheManager
from .model import KVCacheTensors, PagedLlama, run_paged
from .sampling import Sampler, TokenLogprob, greedy_tokens, token_logprobs
from .scheduler import SchedulerOutput, StepResult
from .speculative import accept_greedy, rejection_sample
from .structured_output import GrammarBitmask


class ModelRunner:
    def __init__(self, model: PagedLlama, cache: KVCacheTensors, kv: KVCacheManager,
                 slots: DecodeSlots | None = None):
        self.model = model
        self.cache = cache
        self.kv = kv
        self.slots = slots  # 1-token decodes attend over contiguous rows (decode_slots.py) when set
        self.sampler = Sampler()
        self._bitmask: GrammarBitmask | None = None  # built by the first constrained request

    def mask_to_grammars(self, logits: torch.Tensor, rows: list[tuple[int, object, list[int]]]) -> None:
        """Mask in place the sampled rows of constrained requests: (first row, request, drafts)."""
        if self._bitmask is None:
            self._bitmask = GrammarBitmask(self.model.shape.vocab_size)
        self._bitmask.apply(logits, rows)

    def execute(self, out: SchedulerOutput) -> dict[str, StepResult]:
        if not out.scheduled:
            return {}
        seqs, rows, plans, slot_ids = [], [], [], []
        constrained, num_rows = [], 0  # (first sampled row, request, drafts) of grammar-bound requests
        slots = self.slots
        if slots is not None:
            slots.release_stale()
            results = self._execute_decodes(out)
            if results is not None:
                return results
        for s in out.scheduled:
            req = s.request
            end = s.start + s.num_new_tokens
            confirmed = req.token_ids[s.start:end]
            toks = confirmed + s.spec_token_ids[: s.num_new_tokens - len(confirmed)]
            want: list[int] = []
            prompt_rows = range(0)
            have = len(req.prompt_logprobs)
            if req.wants_prompt_logprobs and have < req.num_prompt_tokens:
                # logits at position p score prompt token p+1; rows already scored before a
                # preemption are not scored again
                first = max(s.start, have - 1) if have else s.start
                prompt_rows = range(first - s.start, max(first, min(end, req.num_prompt_tokens - 1)) - s.start)
                want.extend(prompt_rows)
            n_sample_rows = 0
            if s.samples:
                first = req.num_tokens - 1 - s.start
                n_sample_rows = s.num_new_tokens - first
                want.extend(range(first, s.num_new_tokens))
                if req.grammar is not None:
                    constrained.append((num_rows + len(prompt_rows), req, s.spec_token_ids))
            num_rows += len(want)
            block_ids = self.kv.block_ids(req.request_id)
            seqs.append((block_ids, s.start, toks))
            rows.append(want)
            plans.append((s, prompt_rows, n_sample_rows))
            if slots is not None:
                slot = slots.slot_of.get(req.request_id)
                # a decode (its last confirmed token, then any draft tokens) reads its slot; any
                # other step (a prefill chunk) goes through the pool
                if s.start != req.num_tokens - 1 or s.num_new_tokens > 1 + len(s.spec_token_ids):
                    if slot is not None:  # its row would miss these tokens' K/V
                        slots.release(req.request_id)
                    slot = None
                elif slot is None:
                    slot = slots.assign(req, self.cache, block_ids, s.start)
                slot_ids.append(slot)
        if slots is not None:
            logits = run_with_slots(self.model, self.cache, slots, seqs, rows, slot_ids)
        else:
            logits = run_paged(self.model, self.cache, seqs, rows)
        if constrained:
            self.mask_to_grammars(logits, constrained)

        results: dict[str, StepResult] = {}
        plain_rows, plain_reqs = [], []
        offset = 0
        for s, prompt_rows, n_sample in plans:
            req = s.request
            res = StepResult(sampled=[])
            n_prompt = len(prompt_rows)
            if req.wants_prompt_logprobs and (n_prompt or (s.start == 0 and not req.prompt_logprobs)):
                plp: list[TokenLogprob | None] = [None] if not req.prompt_logprobs else []
                if n_prompt:
                    p0 = s.start + prompt_rows.start + 1
                    targets = torch.tensor(req.token_ids[p0: p0 + n_prompt], device=logits.device)
                    plp += token_logprobs(logits[offset: offset + n_prompt], targets, req.params.prompt_logprobs or 0)
                res.prompt_logprobs = plp
            offset += n_prompt
            if n_sample:
                sample_logits = logits[offset: offset + n_sample]
                if s.spec_token_ids:
                    probs = req.spec_draft_probs
                    if probs is not None:
                        probs = probs[: len(s.spec_token_ids)]
                    res.sampled = rejection_sample(sample_logits, s.spec_token_ids, probs, req.params, req.generator)
                    if req.params.logprobs is not None:
                        ids = torch.tensor(res.sampled, device=logits.device)
                        res.logprobs = token_logprobs(sample_logits[: len(res.sampled)], ids, req.params.logprobs)
                else:
                    plain_rows.append(offset)
                    plain_reqs.append((req, res))
            offset += n_sample
            results[req.request_id] = res
        if plain_rows:
            sel = logits[torch.tensor(plain_rows, device=logits.device)]
            toks = self.sampler(sel, [r.params for r, _ in plain_reqs], [r.generator for r, _ in plain_reqs])
            want_lp = [i for i, (r, _) in enumerate(plain_reqs) if r.params.logprobs is not None]
            if want_lp:
                top_n = max(plain_reqs[i][0].params.logprobs for i in want_lp)
                idx = torch.tensor(want_lp, device=logits.device)
                lps = token_logprobs(sel[idx], torch.tensor([toks[i] for i in want_lp], device=logits.device), top_n)
                for i, lp in zip(want_lp, lps):
                    n = plain_reqs[i][0].params.logprobs
                    lp.top = dict(list(lp.top.items())[:n])
                    plain_reqs[i][1].logprobs = [lp]
            for (req, res), t in zip(plain_reqs, toks):
                res.sampled = [t]
        return results

    def _execute_decodes(self, out: SchedulerOutput) -> dict[str, StepResult] | None:
        """The common steps: every request feeds its last token (and any draft tokens to verify)
        and samples, each in its decode slot, and (compiled models) requests joining the batch
        prefill their whole prompts in the same forward. Done without the general planning (no
        row plans, no per-request index tensors). None when the step is anything else (a chunk of
        a prompt, a prompt after a prefix-cache hit, logprobs asked for, no free slot), which the
        general path then runs."""
        slots, bs = self.slots, self.cache.block_size
        assert slots is not None
        spec = False
        decodes, prompts = [], []
        for s in out.scheduled:
            req = s.request
            if req.params.logprobs is not None or req.params.prompt_logprobs is not None:
                return None
            if s.start == req.num_tokens - 1:
                decodes.append(s)
                spec = spec or bool(s.spec_token_ids)
            elif s.start == 0 and s.num_new_tokens == req.num_tokens > 1:
                prompts.append(s)  # a whole prompt (no prefix hit, not chunked): prefilled beside the decodes
            else:
                return None
        # whole prompts join the compiled step: with plain decodes only, and at least two of them
        # (the variant warmed up; a lone decode has its own specialised graph)
        if prompts and (spec or len(decodes) < 2 or not self.model.pieces.compiled):
            return None
        slot_of, block_ids = slots.slot_of, self.kv.block_ids
        rows = []
        for s in decodes:
            req = s.request
            rid = req.request_id
            slot = slot_of.get(rid)
            if slot is None:
                slot = slots.assign(req, self.cache, block_ids(rid), s.start)
                if slot is None:
                    return None
            rows.append((slot, s))
        rows.sort(key=lambda r: r[0])
        n = len(rows)
        sl = np.fromiter((r[0] for r in rows), dtype=np.int64, count=n)
        pos = np.fromiter((r[1].start for r in rows), dtype=np.int64, count=n)
        if prompts and int(sl[-1]) - int(sl[0]) + 1 != n:  # a running request sits this step out: its row is a hole
            return None
        if not spec:
            blk = np.fromiter((block_ids(s.request.request_id)[s.start // bs] for _, s in rows), dtype=np.int64, count=n)
            whole = [(s.request.token_ids, block_ids(s.request.request_id)) for s in prompts]
            logits = run_decodes(self.model, self.cache, slots, sl, pos, blk, [s.request.token_ids[s.start] for _, s in rows],
                                 prompts=whole)
            reqs = [s.request for _, s in rows] + [s.request for s in prompts]
            constrained = [(i, r, []) for i, r in enumerate(reqs) if r.grammar is not None]
            if constrained:
                self.mask_to_grammars(logits, constrained)
            toks = self.sampler(logits, [r.params for r in reqs], [r.generator for r in reqs])  # all greedy: one argmax
            return {r.request_id: StepResult(sampled=[t]) for r, t in zip(reqs, toks)}
        # decodes verifying draft tokens: rows [last confirmed token, drafts...] per request
        tokens, blk = [], []
        for _, s in rows:
            ids = block_ids(s.request.request_id)
            tokens.append(s.request.token_ids[s.start])
            tokens.extend(s.spec_token_ids)
            blk.extend(ids[p // bs] for p in range(s.start, s.start + s.num_new_tokens))
        nq = np.fromiter((s.num_new_tokens for _, s in rows), dtype=np.int64, count=n)
        logits = run_decodes(self.model, self.cache, slots, sl, pos, np.asarray(blk, dtype=np.int64), tokens, nq)
        constrained, off = [], 0
        for _, s in rows:
            if s.request.grammar is not None:
                constrained.append((off, s.request, s.spec_token_ids))
            off += s.num_new_tokens
        if constrained:
            self.mask_to_grammars(logits, constrained)
        greedy = greedy_tokens(logits) if any(s.request.params.greedy for _, s in rows) else None
        results, off = {}, 0
        for _, s in rows:
            req, m, drafts = s.request, s.num_new_tokens, s.spec_token_ids
            if req.params.greedy:
                sampled = accept_greedy(greedy[off: off + m], drafts)  # type: ignore[index]
            elif drafts:
                probs = req.spec_draft_probs
                sampled = rejection_sample(logits[off: off + m], drafts,
                                           None if probs is None else probs[: len(drafts)], req.params, req.generator)
            else:
                sampled = [int(self.sampler(logits[off: off + 1], [req.params], [req.generator])[0])]
            results[req.request_id] = StepResult(sampled=sampled)
            off += m
        return results
