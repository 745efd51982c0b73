"""Turns one scheduled step into one forward of the target model and the tokens it yields.

All requests of the step, whatever their phase (a prefill chunk, a decode, a decode with k draft
tokens to verify), go through a single forward; logits are computed only for the rows that need
them: the last row of a request that reaches its end, the k+1 verification rows of a speculative
request, and every row of a prompt whose logprobs were asked for. Whichever forward ran (the
general paged one, or the decode-slot step of `_execute_decodes`), tokens come from one sampling
path, `_sample`. Requests that name a LoRA adapter share the forward with the rest: it adds each
adapter's update to its own rows (lora.py). The rows of requests whose output is constrained by a
grammar are masked to it there, before anything samples from them (structured_output.py).
"""

from __future__ import annotations

import numpy as np
import torch

from .decode_slots import DecodeSlots, run_decodes, run_with_slots
from .kv_cache import KVCacheManager
from .model import KVCacheTensors, PagedLlama, run_paged
from .sampling import Sampler, TokenLogprob, greedy_tokens, processed_logprobs, token_logprobs
from .request import Request
from .scheduler import SchedulerOutput, StepResult
from .speculative import accept_greedy, rejection_sample
from .structured_output import GrammarBitmask


class ModelRunner:
    def __init__(self, model: PagedLlama, cache: KVCacheTensors, kv: KVCacheManager,
                 slots: DecodeSlots | None = None, logprobs_mode: str = "raw_logprobs"):
        self.model = model
        self.processed_logprobs = logprobs_mode == "processed_logprobs"  # EngineConfig.logprobs_mode
        self.cache = cache
        self.kv = kv
        self.slots = slots  # 1-token decodes attend over contiguous rows (decode_slots.py) when set
        self.sampler = Sampler()
        self._bitmask: GrammarBitmask | None = None  # built by the first constrained request

    def mask_to_grammars(self, logits: torch.Tensor, picks: list["Pick"]) -> None:
        """Mask in place the sampled rows (the first and one per draft) of constrained requests."""
        constrained = [(off, req, drafts) for req, off, drafts, _ in picks if req.grammar is not None]
        if not constrained:
            return
        if self._bitmask is None:
            self._bitmask = GrammarBitmask(self.model.shape.vocab_size)
        self._bitmask.apply(logits, constrained)

    def execute(self, out: SchedulerOutput) -> dict[str, StepResult]:
        if not out.scheduled:
            return {}
        seqs, rows, plans, slot_ids, adapters = [], [], [], [], []
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
            block_ids = self.kv.block_ids(req.request_id)
            seqs.append((block_ids, s.start, toks))
            rows.append(want)
            adapters.append(req.lora)
            plans.append((s, prompt_rows, n_sample_rows))
            if slots is not None:
                slot = slots.slot_of.get(req.request_id)
                # a decode (its last confirmed token, then any draft tokens) reads its slot; any
                # other step (a prefill chunk) goes through the pool, and so does a decode whose
                # context has outgrown the rows (their capacity is capped by the KV budget)
                if s.start != req.num_tokens - 1 or s.num_new_tokens > 1 + len(s.spec_token_ids) \
                        or not slots.fits(end):
                    if slot is not None:  # its row would miss these tokens' K/V
                        slots.release(req.request_id)
                    slot = None
                elif slot is None:
                    slot = slots.assign(req, self.cache, block_ids, s.start)
                slot_ids.append(slot)
        lora = adapters if any(a is not None for a in adapters) else None
        if slots is not None:
            logits = run_with_slots(self.model, self.cache, slots, seqs, rows, slot_ids, adapters=lora)
        else:
            logits = run_paged(self.model, self.cache, seqs, rows, adapters=lora)

        results: dict[str, StepResult] = {}
        picks: list[Pick] = []
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
                picks.append((req, offset, s.spec_token_ids, res))
            offset += n_sample
            results[req.request_id] = res
        self._sample(logits, picks)
        return results

    def _sample(self, logits: torch.Tensor, picks: list["Pick"]) -> None:
        """The step's one sampling path, whichever forward produced `logits`: each pick is a request,
        the row its rows start at and the draft tokens those rows verify (rows: 1 + drafts). Requests
        with no drafts are sampled together by the Sampler (their own params, processors and seeds,
        one argmax when all are greedy); drafts are verified greedily or by rejection sampling
        (speculative.py). Rows of requests bound by a grammar are masked to it first. Fills each pick's
        StepResult with its tokens and, when asked, their logprobs."""
        self.mask_to_grammars(logits, picks)
        plain = [p for p in picks if not p[2]]
        if plain:
            if len(plain) == logits.shape[0] and all(p[1] == i for i, p in enumerate(plain)):
                rows = logits  # one row per request, in order: the common decode step
            else:
                rows = logits[torch.tensor([p[1] for p in plain], device=logits.device)]
            reqs = [p[0] for p in plain]
            hist = [r.history() if r.params.changes_argmax else None for r in reqs] \
                if any(r.params.changes_argmax for r in reqs) else None
            toks = self.sampler(rows, [r.params for r in reqs], [r.generator for r in reqs], hist)
            for p, t in zip(plain, toks):
                p[3].sampled = [t]
            want_lp = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
            if want_lp:
                top_n = max(reqs[i].params.logprobs for i in want_lp)
                idx = torch.tensor(want_lp, device=logits.device)
                lp_rows = rows[idx]
                if self.processed_logprobs:
                    lp_rows = processed_logprobs(lp_rows, [reqs[i].params for i in want_lp],
                                                 None if hist is None else [hist[i] for i in want_lp])
                lps = token_logprobs(lp_rows, torch.tensor([toks[i] for i in want_lp], device=logits.device), top_n)
                for i, lp in zip(want_lp, lps):
                    lp.top = dict(list(lp.top.items())[:reqs[i].params.logprobs])
                    plain[i][3].logprobs = [lp]
        spec = [p for p in picks if p[2]]
        if not spec:
            return
        greedy = greedy_tokens(logits) if any(p[0].params.greedy for p in spec) else None
        for req, off, drafts, res in spec:
            m = len(drafts) + 1
            if req.params.greedy:
                res.sampled = accept_greedy(greedy[off: off + m], drafts)  # type: ignore[index]
            else:
                probs = req.spec_draft_probs
                res.sampled = rejection_sample(logits[off: off + m], drafts,
                                               None if probs is None else probs[: len(drafts)], req.params, req.generator)
            if req.params.logprobs is not None:
                ids = torch.tensor(res.sampled, device=logits.device)
                lp_rows = logits[off: off + len(res.sampled)]
                if self.processed_logprobs:  # (requests with argmax-changing processors get no drafts)
                    lp_rows = processed_logprobs(lp_rows, [req.params] * len(res.sampled), None)
                res.logprobs = token_logprobs(lp_rows, ids, req.params.logprobs)

    def _execute_decodes(self, out: SchedulerOutput) -> dict[str, StepResult] | None:
        """The common steps: every request feeds its last token (and any draft tokens to verify)
        and samples, each in its decode slot, and (compiled models) requests joining the batch
        prefill their whole prompts in the same forward. Done without the general planning (no
        row plans, no per-request index tensors). None when the step is anything else (a chunk of
        a prompt, a prompt after a prefix-cache hit, prompt logprobs asked for, no free slot), which the
        general path then runs."""
        slots, bs = self.slots, self.cache.block_size
        assert slots is not None
        spec = False
        decodes, prompts = [], []
        for s in out.scheduled:
            req = s.request
            if req.params.prompt_logprobs is not None:
                return None
            if s.start == req.num_tokens - 1:
                if not slots.fits(s.start + s.num_new_tokens):  # outgrew the rows: decodes from the pool
                    return None
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
            reqs = [s.request for _, s in rows] + [s.request for s in prompts]
            tokens = [s.request.token_ids[s.start] for _, s in rows]
            logits = run_decodes(self.model, self.cache, slots, sl, pos, blk, tokens, prompts=whole,
                                 adapters=_adapters(reqs))
            picks = [(r, i, [], StepResult(sampled=[])) for i, r in enumerate(reqs)]
            self._sample(logits, picks)
            return {p[0].request_id: p[3] for p in picks}
        # decodes verifying draft tokens: rows [last confirmed token, drafts...] per request
        tokens, blk = [], []
        for _, s in rows:
            ids = block_ids(s.request.request_id)
            tokens.append(s.request.token_ids[s.start])
            tokens.extend(s.spec_token_ids)
            blk.extend(ids[p // bs] for p in range(s.start, s.start + s.num_new_tokens))
        nq = np.fromiter((s.num_new_tokens for _, s in rows), dtype=np.int64, count=n)
        logits = run_decodes(self.model, self.cache, slots, sl, pos, np.asarray(blk, dtype=np.int64), tokens, nq,
                             adapters=_adapters([s.request for _, s in rows]))
        picks, off = [], 0
        for _, s in rows:
            picks.append((s.request, off, s.spec_token_ids, StepResult(sampled=[])))
            off += s.num_new_tokens
        self._sample(logits, picks)
        return {p[0].request_id: p[3] for p in picks}


# (request, its first logits row, the draft tokens its rows verify, the result to fill)
Pick = tuple[Request, int, list[int], StepResult]


def _adapters(reqs: list[Request]) -> list | None:
    """Each request's LoRA adapter, or None when the step is the base model's alone."""
    adapters = [r.lora for r in reqs]
    return adapters if any(a is not None for a in adapters) else None
