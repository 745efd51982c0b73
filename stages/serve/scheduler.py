"""Continuous batching as pure bookkeeping (Orca; vLLM v1's scheduler).

Each request has `num_computed_tokens` and a target, `num_tokens_with_spec` (its confirmed tokens
plus any draft tokens to verify). A step splits a token budget among requests: running requests
first (FCFS), then waiting ones while the budget, the sequence cap and the block pool allow. One
rule covers a fresh prefill, a chunk of a long prompt, a one-token decode, a prefix-cache hit
(computed tokens start above zero) and speculative verification (the target is k tokens further).
When the pool runs dry the latest-arrived running request is preempted by recompute: its blocks
are freed and it re-enters the waiting queue at the front with its tokens kept.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVCacheManager
from .request import Request, RequestStatus
from .sampling import TokenLogprob


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    """Token budget of one step (prefill chunks + decodes + draft tokens)."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    num_lookahead_tokens: int = 0
    """Extra slots allocated past the target for the draft model's own K/V (= speculative k)."""
    max_model_len: int = 2048
    """Longest prompt + output a request may reach."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed this step, starting at position `start`
    start: int  # num_computed_tokens when scheduled
    spec_token_ids: list[int]  # the draft tokens among the fed tokens (always at the end)

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the confirmed tokens, so a new token gets sampled?"""
        return self.start + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class StepResult:
    """What the runner produced for one request in one step."""

    sampled: list[int]  # accepted draft tokens then one sampled token; empty mid-prefill
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue -----------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        limit = self.config.max_model_len
        if req.num_prompt_tokens + req.params.max_tokens > limit:
            raise ValueError(
                f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.params.max_tokens}) "
                f"exceeds the model's context length of {limit} tokens"
            )
        need = -(-(req.num_prompt_tokens + req.params.max_tokens + self.config.num_lookahead_tokens) // self.kv.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs {need} KV blocks, more than the whole cache holds ({self.kv.pool.num_blocks}); "
                "raise the KV cache memory budget"
            )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, reason: str) -> Request | None:
        """End a request from outside (abort, stop string): free its blocks."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        self.kv.free(request_id)
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step --------------------------------------------------------------------------------
    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_num_computed = 0
        req.spec_token_ids = []
        req.spec_draft_probs = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        lookahead = self.config.num_lookahead_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new + lookahead):
                victim = self.running.pop()  # the latest arrival gives way
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            num_spec = max(0, req.num_computed_tokens + num_new - req.num_tokens)
            out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens, req.spec_token_ids[:num_spec]))
            budget -= num_new
            i += 1

        # waiting requests only when nobody had to give way this step
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            blocks, num_cached = ([], 0) if req.wants_prompt_logprobs else \
                self.kv.get_computed_blocks(req.request_id, req.token_ids, req.prefix_salt)
            num_new = min(req.num_tokens - num_cached, budget)
            extra = lookahead if num_cached + num_new >= req.num_tokens else 0
            if not self.kv.allocate_slots(req.request_id, num_cached + num_new + extra, blocks):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                self.kv.record_prefix_lookup(req.num_prompt_tokens, num_cached)
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, num_cached, []))
            budget -= num_new
        return out

    def update_from_output(self, out: SchedulerOutput, results: dict[str, StepResult]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests; returns the finished."""
        finished = []
        now = time.monotonic()
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            res = results.get(req.request_id)
            req.num_computed_tokens = s.start + s.num_new_tokens
            if res is not None and res.prompt_logprobs:
                req.prompt_logprobs.extend(res.prompt_logprobs)
            if res is not None and res.sampled:
                num_accepted = len(res.sampled) - 1
                req.num_spec_proposed += len(s.spec_token_ids)
                req.num_spec_accepted += num_accepted
                # K/V of rejected draft tokens are garbage: computed stops after the accepted ones
                req.num_computed_tokens -= len(s.spec_token_ids) - num_accepted
                req.spec_token_ids = []
                req.spec_draft_probs = None
                done = False
                for j, tok in enumerate(res.sampled):
                    done = req.append_token(tok)
                    if res.logprobs is not None:
                        req.logprobs.append(res.logprobs[j])
                    if done:
                        break
                if req.first_token_time is None:
                    req.first_token_time = now
                req.last_token_time = now
                if done:
                    finished.append(req)
            self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens, req.prefix_salt)
        for req in finished:
            self.finish_request(req.request_id, req.finish_reason or "stop")
        return finished
