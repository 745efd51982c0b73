"""One generation request as the scheduler sees it: its tokens, how many have K/V computed, the
draft tokens proposed for it, its grammar matcher when its output is constrained, and its status
(vLLM v1's Request, in our words)."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .lora import LoRAAdapter
from .sampling import SamplingParams, TokenHistory, TokenLogprob

log = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS and end-of-turn ids (generation_config.json)
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    lora: LoRAAdapter | None = None  # the adapter it runs with (lora.py); kept even if unloaded meanwhile

    token_ids: list[int] = field(init=False)  # prompt then output, the confirmed tokens
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    spec_token_ids: list[int] = field(default_factory=list)  # draft proposals to verify next step
    spec_draft_probs: torch.Tensor | None = None  # [k, V] draft distribution (None: deterministic draft)
    draft_num_computed: int = 0  # tokens whose K/V the draft model wrote (valid up to the accepted ones)
    mtp_computed: list[int] = field(default_factory=list)  # per MTP depth: positions whose K/V are final
    mtp_preemptions: int = 0  # num_preemptions when mtp_computed was last valid (a preemption frees the blocks)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    last_emit_time: float | None = None  # when the engine last handed tokens out (inter-token latency)
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    grammar: Any = None  # xgrammar GrammarMatcher of a structured output (structured_output.py)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def prefix_salt(self) -> bytes | None:
        """What its prefix-cache block hashes are keyed by besides the tokens: the adapter's K/V differ."""
        return None if self.lora is None else self.lora.cache_salt

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end this request: EOS and end of turn (unless ignore_eos), and its stop_token_ids."""
        own = frozenset(self.params.stop_token_ids)
        return own if self.params.ignore_eos else own | self.eos_token_ids

    def history(self) -> TokenHistory:
        return TokenHistory(self.prompt_token_ids, self.output_token_ids, self.stop_token_ids)

    def append_token(self, token_id: int) -> bool:
        """Add one sampled token; True when it ends the request (EOS, a stop token, its grammar's
        end, max_tokens)."""
        self.token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            # sampling was masked by this grammar: a refused token is a bug, not the model's doing
            log.error("request %s: token %d is outside its grammar; ending it", self.request_id, token_id)
            self.finish_reason = "stop"
            return True
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason = "stop"
            return True
        if token_id in self.params.stop_token_ids:
            self.finish_reason = "stop"
            return True
        if self.grammar is not None and self.grammar.is_terminated():
            self.finish_reason = "stop"  # the grammar ended on a stop token, ignore_eos or not
            return True
        if self.num_output_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
            return True
        return False
