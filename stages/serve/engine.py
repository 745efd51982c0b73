"""The engine: tokenizer, scheduler, runner and proposer wired into `step()`, plus the in-process
API the evaluate stage and GRPO rollouts use (`generate`, `score`, `update_weights`).

One step: the scheduler splits the token budget, the runner does one forward and samples, the
scheduler books the result, stop strings are checked on the detokenised text, and the proposer
guesses the next draft tokens. Nothing here is thread-safe; `AsyncEngine` (async_engine.py) steps
it on a thread of its own, the only one that changes it, for the server's event loop.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import torch

from .decode_slots import DecodeSlots
from .gguf_loader import find_gguf
from .kv_budget import KVBudget, plan_kv_budget, slot_bytes
from .kv_cache import Block, KVCacheManager, kv_bytes_per_token, prefix_block_hashes
from .lora import LoRAAdapter, load_lora_adapter
from .metrics import ServeMetrics
from .model import KVCacheTensors, PagedLlama
from .request import Request
from .runner import ModelRunner
from .sampling import SamplingParams, TokenLogprob, make_generator
from .scheduler import Scheduler, SchedulerConfig
from .mtp_proposer import MTPProposer
from .speculative import DraftModelProposer, NgramProposer
from .structured_output import GrammarBackend

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Engine options (each one is also a `serve` / `bench serve` CLI option)."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory_gb: float = 0.25
    """Memory budget of the KV cache: the paged pool and the decode slots' rows together (kv_budget.py);
    the number of blocks follows from the per-token size and what the rows reserve."""
    num_kv_blocks: int | None = None
    """Override the block count (tests use tiny pools to force preemption); the budget is then not applied."""
    kv_cache_dtype: str = "auto"
    """"auto" (the model's dtype) or "fp8" (e4m3 with a scale per slot and head)."""
    enable_prefix_caching: bool = True
    """Share the K/V of common prompt prefixes between requests."""
    max_num_batched_tokens: int = 512
    """Token budget of one step (prefill chunks beyond it are split)."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_model_len: int | None = None
    """Longest prompt + output; default the checkpoint's max_position_embeddings."""
    dtype: str = "float32"
    """Compute dtype: float32 (CPU default), bfloat16 or float16."""
    device: str = "cpu"
    """"cpu" or "cuda"."""
    speculative: str | None = None
    """None, "ngram" (prompt lookup), "draft" (needs draft_model_dir) or "mtp" (the model's own
    multi-token-prediction modules, from the export's mtp.safetensors sidecar; mtp_proposer.py)."""
    draft_model_dir: str | None = None
    """Hugging Face folder of the draft model (same tokenizer)."""
    num_speculative_tokens: int = 5
    """k: draft tokens proposed per step (5, as vLLM's documented examples, with ngram_max 4); with
    mtp, at most the checkpoint's MTP depth (fewer when it has fewer)."""
    ngram_max: int = 4
    """Longest suffix matched by prompt lookup."""
    ngram_min: int = 1
    """Shortest suffix matched by prompt lookup."""
    max_waiting: int = 512
    """Waiting requests beyond which the server answers 429."""
    served_model_name: str | None = None
    """Name in /v1/models; default the folder name."""
    stream_interval: int = 4
    """Hand a running request's new tokens out once this many have accumulated (the first token and
    the last are handed out at once; requests with stop strings stream every token). Larger values
    trade streaming smoothness for less per-token host work (vLLM's --stream-interval, default 1).
    4 here: every chunk costs the engine (detokenising, an output), the server (an SSE event, a
    socket write) and the client (a parse) about the same whatever it holds, and at 1 they took
    ~12% of the server's CPU at 32 concurrent requests (tiny model); at 4 a stream gets a chunk every
    ~15-20 ms under that load (faster than a 60 Hz display refreshes, far faster than anyone
    reads), the first token still goes out the step it is sampled, and lone requests, whose steps
    take ~1 ms, get a chunk every ~4 ms. 1 streams every token."""
    decode_slots: bool = True
    """Decoding requests also keep their K/V in one contiguous row each, read in place by decode
    attention (and speculative verification) instead of gathered from blocks every step (off with
    an FP8 cache). The max_num_seqs rows are paid for out of kv_cache_memory_gb (kv_budget.py)."""
    enforce_eager: bool = True
    """Run the forward eagerly. False compiles the all-decode step (every request decoding in its
    decode slot, with or without drafts to verify) with torch.compile, warmed up at engine start
    (compiled_forward.py), as vLLM compiles by default. Eager here, so that engines built
    in-process (evaluate, GRPO rollouts, tests) start at once; `eightfold serve` and `bench serve`
    compile unless given --enforce-eager."""
    logprobs_mode: str = "raw_logprobs"
    """What a sampled token's logprobs are of (vLLM's --logprobs-mode): "raw_logprobs", the model's own
    distribution (the default); "processed_logprobs", the distribution it was sampled from (after
    penalties, temperature, min_p, top-k and top-p), which RL needs for its importance ratios."""

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        bad = sorted(set(options) - known)
        if bad:
            raise ValueError(f"unknown engine option(s) {bad}; known: {sorted(known)}")
        return cls(**{k: v for k, v in options.items() if v is not None or k in ("speculative",)})

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.speculative not in (None, "ngram", "draft", "mtp"):
            raise ValueError(f"speculative must be None, 'ngram', 'draft' or 'mtp', got {self.speculative!r}")
        if self.speculative == "draft" and not self.draft_model_dir:
            raise ValueError("speculative='draft' needs draft_model_dir")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1, got {self.stream_interval!r}")
        if self.speculative and self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {self.logprobs_mode!r}")


@dataclass
class RequestOutput:
    """What a request produced so far (`delta_*`: new since the previous output)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_cached_tokens: int = 0
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)  # of delta_token_ids (when asked), as of this output


@dataclass
class HeldKV:
    """A finished request whose prompt blocks are kept referenced until they are exported
    (prefill/decode disaggregation, kv_transfer.py): vLLM's connector delays the free the same way."""

    request: Request
    blocks: list[Block]  # the leading full prompt blocks, one reference each taken for the export
    block_hashes: list[bytes]


@dataclass
class PrefilledRequest:
    """A request prefilled by another engine: its first output token(s), their logprobs and the
    state of its seeded generator after sampling them, so it continues here as it would have there."""

    output_token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generator_state: torch.Tensor | None = None
    arrival_time: float | None = None  # when the request reached the service (time.monotonic), for its e2e latency


class _Detok:
    """Incremental text of one request (vLLM's prefix/read offsets): each step decodes only a few
    tokens before the new ones, so the cost does not grow with the output. A tail that could still
    become a stop string, or is an incomplete UTF-8 sequence, is held back from the stream."""

    def __init__(self, stop: list[str], decode):
        self.stop = stop
        self.decode = decode
        self.hold = max((len(x) for x in stop), default=1) - 1
        self.sent = 0
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def update(self, ids: list[int]) -> None:
        if self.read_offset >= len(ids):
            return
        prefix = self.decode(ids[self.prefix_offset:self.read_offset])
        full = self.decode(ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)

    def flush(self, ids: list[int]) -> None:
        """At the end: whatever is left, incomplete bytes included."""
        if self.read_offset < len(ids):
            prefix = self.decode(ids[self.prefix_offset:self.read_offset])
            self.text += self.decode(ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(ids)


def model_stop_token_ids(model_dir: Path, *ids: int | None) -> frozenset[int]:
    """The ids that end a generation: `ids` (config.json's and the tokenizer's EOS) and every id of
    config.json's and generation_config.json's `eos_token_id` (a chat model lists its end-of-turn
    token there; vLLM and transformers' generate stop on all of them)."""
    found = {i for i in ids if i is not None}
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            found.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(int(i) for i in found)


class RequestChecks:
    """What turns a prompt into ids and refuses a request that can never run, shared by the engine and
    the API process's stand-in for an engine core in another process (engine_core.EngineFront). Needs
    `tokenizer`, `max_model_len`, `vocab_size` and `_grammar_backend` (None until the first grammar)."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    _grammar_backend: GrammarBackend | None

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = [int(t) for t in prompt]
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (a 400 for the server) when the request can never run."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {self.max_model_len} tokens"
            )
        if params.structured_output is not None:  # an invalid schema, regex or grammar fails here
            self.grammar_backend().compile(params.structured_output)

    def grammar_backend(self) -> GrammarBackend:
        """The structured-output compiler over this engine's vocabulary (structured_output.py)."""
        if self._grammar_backend is None:
            self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size)
        return self._grammar_backend


class LLMEngine(RequestChecks):
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, tokenizer=None,
                 metrics: ServeMetrics | None = None):
        from transformers import AutoTokenizer

        self.config = c = config or EngineConfig()
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists() and find_gguf(self.model_dir) is None:
            raise FileNotFoundError(f"{self.model_dir} is neither a Hugging Face checkpoint folder (no config.json) "
                                    "nor a folder with a GGUF file")
        self.model_name = c.served_model_name or self.model_dir.name
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(self.model_dir))
        dtype = DTYPES[c.dtype]
        self.model = PagedLlama.from_pretrained(self.model_dir, dtype=dtype, device=c.device)
        shape = self.model.shape
        self.max_model_len = min(c.max_model_len or shape.max_position_embeddings, shape.max_position_embeddings)
        self.vocab_size = shape.vocab_size
        fp8 = c.kv_cache_dtype == "fp8"
        # fp8 stores 1 byte per value plus a 4-byte scale per (token, head): count both
        per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, 1 if fp8 else dtype.itemsize)
        if fp8:
            per_token += 2 * shape.num_layers * shape.num_kv_heads * 4
        self.draft_model = None
        if c.speculative == "draft":
            self.draft_model = PagedLlama.from_pretrained(c.draft_model_dir, dtype=dtype, device=c.device)
            ds = self.draft_model.shape
            if ds.vocab_size != shape.vocab_size:
                raise ValueError(f"draft vocab {ds.vocab_size} != target vocab {shape.vocab_size}: "
                                 "the draft must share the target's tokenizer")
            per_token += kv_bytes_per_token(ds.num_layers, ds.num_kv_heads, ds.head_dim, dtype.itemsize)
        mtp = None
        if c.speculative == "mtp":
            from stages.export.hf import read_mtp_sidecar

            mtp = read_mtp_sidecar(self.model_dir)
            if mtp is None:
                raise ValueError(f"speculative='mtp': {self.model_dir} has no MTP sidecar (mtp.json, mtp.safetensors); "
                                 "train with model.mtp_depth > 0 and export it")
            mtp_k = min(c.num_speculative_tokens, mtp[0])
            # each drafted depth: one layer of K/V and its input hidden state per token
            per_token += mtp_k * (kv_bytes_per_token(1, shape.num_kv_heads, shape.head_dim, dtype.itemsize)
                                  + shape.hidden_size * dtype.itemsize)
        self.kv_bytes_per_token = per_token
        # the decode slots' rows hold the target's K/V once more: paid for out of the same budget
        slot_per_token = kv_bytes_per_token(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype.itemsize) \
            if c.decode_slots and not fp8 else 0
        if c.num_kv_blocks:  # the pool given outright (tests): no budget to split, rows may grow to a whole context
            num_blocks, row_capacity = c.num_kv_blocks, self.max_model_len + 1 if slot_per_token else None
            self.kv_budget = KVBudget(num_blocks, row_capacity, num_blocks * c.block_size * per_token,
                                      slot_bytes(c.max_num_seqs, row_capacity, shape.num_layers, slot_per_token,
                                                 DecodeSlots.INITIAL_CAPACITY) if row_capacity else 0)
        else:
            self.kv_budget = plan_kv_budget(int(c.kv_cache_memory_gb * 2**30), block_size=c.block_size,
                                            pool_bytes_per_token=per_token, max_model_len=self.max_model_len,
                                            num_slots=c.max_num_seqs, slot_bytes_per_token=slot_per_token,
                                            num_layers=shape.num_layers, initial_capacity=DecodeSlots.INITIAL_CAPACITY)
            num_blocks, row_capacity = self.kv_budget.num_blocks, self.kv_budget.slot_row_capacity
        log.info("%s: %s", self.model_name, self.kv_budget.describe(c.block_size, c.max_num_seqs))
        self.kv = KVCacheManager(num_blocks, c.block_size, c.enable_prefix_caching)
        self.cache = KVCacheTensors(shape, num_blocks, c.block_size, dtype, self.model.device, fp8=fp8)
        k = (mtp_k if mtp is not None else c.num_speculative_tokens) if c.speculative else 0
        self.scheduler = Scheduler(SchedulerConfig(c.max_num_batched_tokens, c.max_num_seqs, k, self.max_model_len), self.kv)
        slots = None
        if row_capacity is not None:
            slots = DecodeSlots(shape, c.max_num_seqs, row_capacity, dtype, self.model.device)
        self.proposer: NgramProposer | DraftModelProposer | MTPProposer | None = None
        if c.speculative == "ngram":
            self.proposer = NgramProposer(k, c.ngram_max, c.ngram_min, self.max_model_len)
        elif c.speculative == "draft":
            draft_cache = KVCacheTensors(self.draft_model.shape, num_blocks, c.block_size, dtype, self.model.device)
            self.proposer = DraftModelProposer(self.draft_model, draft_cache, k, self.max_model_len)
        elif mtp is not None:  # before the warm-up: the target's steps then compile with the hidden-state writes
            self.proposer = MTPProposer(self.model, mtp[1], mtp[0], k, num_blocks, c.block_size, self.max_model_len)
        self.compile_seconds = 0.0
        if not c.enforce_eager:
            if slots is None:  # what is compiled is the decode-slot step
                log.warning("enforce_eager=False has no effect without decode slots (FP8 KV cache or "
                            "decode_slots=False): running eager")
            elif self.model.compile() and self.model.pieces.warm_up_decode(self.cache, slots, k):
                self.compile_seconds = self.model.pieces.compile_seconds  # at start: no request pays for it
        self.runner = ModelRunner(self.model, self.cache, self.kv, slots, c.logprobs_mode)
        self.eos_token_id = shape.eos_token_id if shape.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = model_stop_token_ids(self.model_dir, self.eos_token_id, self.tokenizer.eos_token_id)
        self._grammar_backend: GrammarBackend | None = None  # built by the first constrained request
        self.metrics = metrics or ServeMetrics()
        self.metric_labels = self.metrics.engine_labels(self.model_name)  # vLLM's model_name and engine
        self.metrics.running.set_function(lambda: len(self.scheduler.running), **self.metric_labels)
        self.metrics.waiting.set_function(lambda: len(self.scheduler.waiting), **self.metric_labels)
        self.metrics.kv_usage.set_function(self.kv.usage, **self.metric_labels)
        self._detok: dict[str, _Detok] = {}
        self._ids = itertools.count()
        self._last_prefix = (0, 0)
        self.num_steps = 0
        self._emitted: dict[str, int] = {}  # output tokens handed out so far, per request
        self._kv_hold: set[str] = set()  # requests whose prompt blocks are kept when they finish
        self.held_kv: dict[str, HeldKV] = {}
        self.weights_version = 0  # bumped by update_weights: K/V exported before it are stale
        self.loras: dict[str, LoRAAdapter] = {}  # LoRA adapters by served name (load_lora)
        self._checkpoint_fingerprint: str | None = None

    # -- requests --------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # the Rust tokenizer directly: transformers' wrapper costs more than the decode
            return backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, hold_kv: bool = False, lora_name: str | None = None) -> str:
        """Queue a request. `hold_kv`: when it finishes, keep its full prompt blocks referenced
        (`held_kv`) until `release_held_kv`, so their K/V can be exported (a prefill engine's requests).
        `lora_name`: a loaded LoRA adapter it runs with (LookupError when none is loaded by that name)."""
        return self.enqueue(self.make_request(prompt, params, request_id, lora_name), hold_kv)

    def make_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, lora_name: str | None = None) -> Request:
        """A request ready to queue: tokenised, checked, its grammar compiled and its adapter resolved,
        with nothing in the engine changed (the server prepares requests on its event loop while the
        engine thread steps, async_engine.py). ValueError / LookupError as add_request."""
        req = self._new_request(prompt, params or SamplingParams(), request_id or f"req-{next(self._ids)}")
        if lora_name is not None:
            req.lora = self.lora_adapter(lora_name)
        return req

    def enqueue(self, req: Request, hold_kv: bool = False) -> str:
        """Queue a request made by make_request (`hold_kv` as add_request)."""
        self._enqueue(req)
        if hold_kv:
            self._kv_hold.add(req.request_id)
        return req.request_id

    def _new_request(self, prompt: str | Sequence[int], params: SamplingParams, request_id: str) -> Request:
        ids = self.encode(prompt)
        self.check_request(ids, params)
        req = Request(request_id, ids, params, eos_token_ids=self.eos_token_ids,
                      generator=make_generator(params, self.model.device))
        if params.structured_output is not None:
            # the grammar's end must be followed by a token that ends the request: the request's
            # whole stop set (EOS, end of turn, its stop_token_ids), whatever ignore_eos says
            stops = sorted(self.eos_token_ids | set(params.stop_token_ids))
            req.grammar = self.grammar_backend().matcher(params.structured_output, stops)
        return req

    def _enqueue(self, req: Request) -> None:
        self.scheduler.add_request(req)
        self._detok[req.request_id] = _Detok(req.params.stop, self._decode)
        self.metrics.prompt_tokens.inc(req.num_prompt_tokens, **self.metric_labels)

    def add_prefilled_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str,
                              prefilled: PrefilledRequest) -> RequestOutput:
        """Continue a request whose prompt another engine prefilled (its K/V imported into this
        engine's prefix cache beforehand, kv_transfer.py) and whose first token(s) it sampled.
        Returns the output handing those tokens out; the request then decodes here like any other
        (its prompt's full blocks are prefix-cache hits, so only the tail is computed again)."""
        if not prefilled.output_token_ids:
            raise ValueError("a prefilled request needs the token(s) sampled by the prefill engine")
        req = self._new_request(prompt_ids, params, request_id)
        if prefilled.arrival_time is not None:
            req.arrival_time = prefilled.arrival_time
        if req.generator is not None and prefilled.generator_state is not None:
            req.generator.set_state(prefilled.generator_state)
        done = False
        for tok in prefilled.output_token_ids:
            done = req.append_token(int(tok))
            if done:
                break
        req.logprobs.extend(prefilled.logprobs[:req.num_output_tokens])
        self._enqueue(req)
        # handed out here, as the engine's first output: no TTFT is recorded for it (the prefill
        # engine's output was the first token), later tokens count as inter-token latency
        req.last_emit_time = time.monotonic()
        if done:
            self.scheduler.finish_request(request_id, req.finish_reason or "stop")
        else:
            self._emitted[request_id] = req.num_output_tokens
        out = self._output(req, req.num_output_tokens)
        if out.finished:  # also a stop string in the handed-over text
            self._emitted.pop(request_id, None)
        return out

    def abort_request(self, request_id: str) -> bool:
        self._detok.pop(request_id, None)
        self._emitted.pop(request_id, None)
        self._kv_hold.discard(request_id)
        self.release_held_kv(request_id)
        req = self.scheduler.finish_request(request_id, "abort")
        if req is not None:
            self.metrics.requests.inc(**self.metric_labels, finished_reason="abort")
        return req is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- one step --------------------------------------------------------------------------------
    def step(self, stream_interval: int | None = None) -> list[RequestOutput]:
        """One engine step; outputs of the requests that got tokens (or finished), subject to
        `stream_interval` (default: the config's)."""
        interval = stream_interval or self.config.stream_interval
        sched = self.scheduler.schedule()
        if sched.preempted:
            self.metrics.preemptions.inc(len(sched.preempted), **self.metric_labels)
        results = self.runner.execute(sched)
        finished_reqs = self.scheduler.update_from_output(sched, results)
        if self._kv_hold:
            for req in finished_reqs:
                self._hold_kv(req)
        self.num_steps += 1
        outputs = []
        now = time.monotonic()
        m, labels = self.metrics, self.metric_labels
        emitted = self._emitted
        # metrics gathered over the step and recorded once (one lock and label lookup per step, not per request)
        ttft, queue, itl = [], [], []
        num_generated = num_drafts = num_proposed = num_accepted = 0
        accepted_at: list[int] = []  # per draft position: drafts accepted there this step
        for s in sched.scheduled:
            req = s.request
            rid = req.request_id
            if s.spec_token_ids:
                res = results.get(rid)
                if res is not None and res.sampled:
                    num_drafts += 1
                    num_proposed += len(s.spec_token_ids)
                    num_accepted += len(res.sampled) - 1
                    for pos in range(len(res.sampled) - 1):
                        if pos == len(accepted_at):
                            accepted_at.append(0)
                        accepted_at[pos] += 1
            done = emitted.get(rid, 0)
            new = req.num_output_tokens - done
            finished = req.is_finished
            if not finished and (new == 0 or (done and new < interval and not req.params.stop)):
                continue  # nothing new, or buffered until `interval` tokens have accumulated
            if finished:
                emitted.pop(rid, None)
            else:
                emitted[rid] = done + new
            if new and not done:  # the request's first tokens
                ttft.append(now - req.arrival_time)
                queue.append((req.first_scheduled_time or now) - req.arrival_time)
            elif new:
                itl.append((now - (req.last_emit_time or now)) / new)
            req.last_emit_time = now
            num_generated += new
            out = self._output(req, new)
            if out.finished:  # also a stop string found just now
                emitted.pop(rid, None)
            outputs.append(out)
        if num_proposed:
            m.spec_drafts.inc(num_drafts, **labels)
            m.spec_proposed.inc(num_proposed, **labels)
            m.spec_accepted.inc(num_accepted, **labels)
            for pos, n in enumerate(accepted_at):
                m.spec_accepted_per_pos.inc(n, position=str(pos), **labels)
        if num_generated:
            m.generation_tokens.inc(num_generated, **labels)
        for hist, values in ((m.ttft, ttft), (m.queue, queue), (m.itl, itl), (m.itl_legacy, itl)):
            if values:
                hist.observe_many(values, **labels)
        queries, hits = self.kv.stats.queries, self.kv.stats.hits
        m.prefix_queries.inc(queries - self._last_prefix[0], **labels)
        m.prefix_hits.inc(hits - self._last_prefix[1], **labels)
        self._last_prefix = (queries, hits)
        if self.proposer is not None:
            decoding = [r for r in self.scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
            if isinstance(self.proposer, (DraftModelProposer, MTPProposer)):
                self.proposer.propose(decoding, {r.request_id: self.kv.block_ids(r.request_id) for r in decoding})
            else:
                self.proposer.propose(decoding)
        return outputs

    def _output(self, req: Request, num_new: int) -> RequestOutput:
        d = self._detok.get(req.request_id) or _Detok(req.params.stop, self._decode)
        out_ids = req.output_token_ids
        if num_new or req.is_finished:
            seen = len(d.text)
            d.update(out_ids)
            if req.is_finished:
                d.flush(out_ids)
            if d.stop and len(d.text) > seen:
                lo = max(0, seen - d.hold)
                hits = [(i, x) for x in d.stop if (i := d.text.find(x, lo)) >= 0]
                if hits:
                    at, found = min(hits)
                    d.text = d.text[:at + (len(found) if req.params.include_stop_str_in_output else 0)]
                    if not req.is_finished:
                        self.scheduler.finish_request(req.request_id, "stop")
                        req.finish_reason = "stop"
                        if self._kv_hold:
                            self._hold_kv(req)
        finished = req.is_finished
        upto = len(d.text) if finished else max(d.sent, len(d.text) - d.hold)
        if not finished and d.text[:upto].endswith("\ufffd"):
            upto = max(d.sent, upto - 1)
        delta = d.text[d.sent:upto]
        d.sent = upto
        if finished:
            self._detok.pop(req.request_id, None)
            now = time.monotonic()
            self.metrics.e2e.observe(now - req.arrival_time, **self.metric_labels)
            n_out = req.num_output_tokens
            if n_out > 1 and req.first_token_time is not None and req.last_token_time is not None:
                # vLLM's per-request TPOT: the decode time spread over the tokens after the first
                self.metrics.tpot.observe((req.last_token_time - req.first_token_time) / (n_out - 1),
                                          **self.metric_labels)
            self.metrics.requests.inc(**self.metric_labels, finished_reason=req.finish_reason or "stop")
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=out_ids,
            text=d.text[:upto],
            delta_text=delta,
            delta_token_ids=out_ids[len(out_ids) - num_new:] if num_new else [],
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens,
            # a copy: `logprobs` is the request's own list, which grows while this output waits to be streamed
            delta_logprobs=req.logprobs[len(req.logprobs) - num_new:] if num_new and req.logprobs else [],
        )

    # -- in-process API --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_name: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching inside); outputs in prompt order. `lora_name`: a
        loaded LoRA adapter every prompt runs with."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine (requests are in flight)")
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = [self.add_request(p, sp, lora_name=lora_name) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step(stream_interval=1 << 30):  # only final outputs are wanted here
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    def score(self, pairs: Sequence[tuple[str | Sequence[int], str | Sequence[int]]]) -> list[tuple[float, bool]]:
        """Loglikelihood of each continuation given its context, and whether it is the greedy
        continuation (lm-eval's `loglikelihood`). Strings are tokenised as context+continuation."""
        reqs = []
        for ctx, cont in pairs:
            if isinstance(ctx, str) and isinstance(cont, str):
                whole = self.encode(ctx + cont)
                n_ctx = len(self.encode(ctx))
                # a merge across the boundary: take the continuation as the tokens past the context
                n_ctx = min(n_ctx, len(whole) - 1)
            else:
                c, x = self.encode(ctx), self.encode(cont)
                whole, n_ctx = c + x, len(c)
            if n_ctx < 1 or len(whole) <= n_ctx:
                raise ValueError("score() needs a non-empty context and continuation")
            reqs.append((whole, n_ctx))
        outs = self.generate([w for w, _ in reqs], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
        result = []
        for (whole, n_ctx), o in zip(reqs, outs):
            lps = o.prompt_logprobs[n_ctx:]
            total = sum(lp.logprob for lp in lps)
            greedy = all(max(lp.top, key=lp.top.get) == lp.token_id for lp in lps)
            result.append((total, greedy))
        return result

    # -- LoRA adapters (lora.py) ------------------------------------------------------------------
    def load_lora(self, name: str, path: str | Path | tuple[dict, dict[str, torch.Tensor]],
                  replace: bool = False) -> LoRAAdapter:
        """Load a PEFT LoRA adapter (a folder, or its config and tensors in memory) under `name` (requests
        naming it get it). `replace`: swap the
        weights of an adapter already loaded by that name (vLLM's load_inplace); its running requests
        finish with the old ones. ValueError for a name taken or an adapter this model cannot serve,
        FileNotFoundError for a folder with no adapter."""
        if not name or name == self.model_name:
            raise ValueError(f"a LoRA adapter needs a name other than the base model's ({self.model_name!r})")
        if name in self.loras and not replace:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = load_lora_adapter(name, path, self.model.shape, self.model.dtype, self.model.device)
        self.loras[name] = adapter
        log.info("loaded LoRA adapter %r from %s (r=%d, %d bytes)", name, adapter.path, adapter.rank, adapter.nbytes)
        return adapter

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (LookupError when none has that name). Requests already running with it
        keep it to their end; new ones naming it are refused."""
        if self.loras.pop(name, None) is None:
            raise LookupError(f"no LoRA adapter named {name!r} is loaded")

    def lora_adapter(self, name: str) -> LoRAAdapter:
        adapter = self.loras.get(name)
        if adapter is None:
            raise LookupError(f"no LoRA adapter named {name!r} is loaded; loaded: {sorted(self.loras)}")
        return adapter

    # -- K/V kept for export (prefill/decode disaggregation) -------------------------------------
    def _hold_kv(self, req: Request) -> None:
        """Right after `req` finished (its blocks just went to the free queue, their hashes intact,
        nothing allocated since): take a reference to its leading full prompt blocks."""
        rid = req.request_id
        if rid not in self._kv_hold:
            return
        self._kv_hold.discard(rid)
        bs = self.kv.block_size
        n_full = min(req.num_computed_tokens, req.num_prompt_tokens) // bs
        hashes = prefix_block_hashes(req.prompt_token_ids, bs, n_full, req.prefix_salt)
        blocks = []
        for h in hashes:
            b = self.kv.pool.lookup(h)
            if b is None:  # prefix caching off, or the block was never cached
                break
            blocks.append(b)
        self.kv.pool.touch(blocks)
        self.held_kv[rid] = HeldKV(req, blocks, hashes[:len(blocks)])

    def weights_fingerprint(self) -> str:
        """Identity of the weights the cached K/V were computed with (checked on K/V import)."""
        if self._checkpoint_fingerprint is None:
            from .kv_transfer import checkpoint_fingerprint

            self._checkpoint_fingerprint = checkpoint_fingerprint(self.model_dir)
        return f"{self._checkpoint_fingerprint}+v{self.weights_version}"

    def release_held_kv(self, request_id: str) -> None:
        held = self.held_kv.pop(request_id, None)
        if held is not None:
            self.kv.pool.free(list(reversed(held.blocks)))  # tail blocks evicted first, as in KVCacheManager.free

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """New weights (Hugging Face names) between generations (GRPO): copied in place into the engine's
        own tensors when it holds them densely, and then `state_dict` may be only the tensors that changed
        (vLLM's in-place weight sync); otherwise every weight is reloaded. Drops the prefix cache, whose
        K/V were computed by the old weights."""
        if self.has_unfinished():
            raise RuntimeError("update_weights() needs an idle engine (requests are in flight)")
        if not self.model.copy_weights(state_dict):
            self.model.load_weights(state_dict)
        self.weights_version += 1
        for rid in list(self.held_kv):  # computed by the old weights: nothing to export any more
            self.release_held_kv(rid)
        self.kv.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
