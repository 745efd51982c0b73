"""Prefill/decode disaggregation behind one replica's interface (seed, serving techniques:
"prefill and decode want different hardware balances, so large deployments run them on separate
GPU pools and ship the KV cache between them"; vLLM's disaggregated prefilling, DistServe, Zhong
et al. 2024).

`DisaggregatedEngine` holds a pool of prefill engines and a pool of decode engines, each an
`LLMEngine` with its own block pool behind an `AsyncEngine`, and offers AsyncEngine's `generate`, so
a `Router` (and through it the server) uses it as a replica. A request is prefilled on the least
loaded prefill engine with max_tokens=1 (its K/V held when it finishes), its K/V exported as a
payload of bytes (kv_transfer.py), imported into the least loaded decode engine's prefix cache, and
continued there from the first token: the decode engine computes only the prompt's tail. The first
token reaches the client once the K/V has landed, so time to first token counts the transfer.

In one process here; the payload is the same bytes that would cross a socket or the object store,
and its size and the transfer time (export, serialise, deserialise, import) are recorded as
`eightfold:kv_transfer_bytes_total` and `eightfold:kv_transfer_seconds`. Requests asking for prompt
logprobs (which need every prompt token's logits) and requests of at most one token (nothing to
decode) run whole on a decode engine. Metrics under the service's model name count each request
once (TTFT from the front's arrival, through the transfer); the prefill engines carry their own
name (`<model>-prefill`, see `prefill_engine_config`), so the prefill pool is watched on its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import AsyncIterator, Sequence

from .async_engine import AsyncEngine
from .engine import EngineConfig, LLMEngine, RequestOutput
from .kv_transfer import KVPayload, KVTransferError, export_kv, import_kv, kv_layout, layout_diffs
from .sampling import SamplingParams


def prefill_engine_config(config: EngineConfig, model_name: str) -> EngineConfig:
    """A decode engine's config made a prefill engine's: its own name (its metrics are the prefill
    pool's: TTFT of the prefill leg, prompt tokens, KV usage), no decode slots, no compiled decode
    step and no speculation, since it never decodes. Block size and dtypes stay: the K/V must fit."""
    return dataclasses.replace(config, served_model_name=f"{model_name}-prefill", decode_slots=False,
                               enforce_eager=True, speculative=None, draft_model_dir=None)


@dataclasses.dataclass
class TransferStats:
    num_transfers: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    num_blocks: int = 0  # full prompt blocks shipped
    num_imported: int = 0  # of which the decode pool did not already hold


class DisaggregatedEngine:
    def __init__(self, prefill: Sequence[AsyncEngine], decode: Sequence[AsyncEngine]):
        if not prefill or not decode:
            raise ValueError("disaggregation needs at least one prefill engine and one decode engine")
        self.prefill = list(prefill)
        self.decode = list(decode)
        ref = kv_layout(self.decode[0].engine)
        for e in self.prefill + self.decode:
            if not e.engine.kv.enable_prefix_caching:
                raise ValueError(f"engine {e.model_name}: disaggregation ships K/V through the prefix cache, "
                                 "which must be on (enable_prefix_caching)")
            diffs = layout_diffs(kv_layout(e.engine), ref, e.model_name, self.decode[0].model_name)
            if diffs:
                raise KVTransferError(f"engine {e.model_name} cannot exchange K/V with {self.decode[0].model_name}: "
                                      + "; ".join(diffs))
        self.stats = TransferStats()
        self._ids = itertools.count()
        self._in_flight = 0

    # -- what the router and the server read from a replica ---------------------------------------
    @property
    def engine(self) -> LLMEngine:
        """The first decode engine: tokenizer, checks, metrics registry and config of this replica."""
        return self.decode[0].engine

    @property
    def model_name(self) -> str:
        return self.decode[0].model_name

    @property
    def load(self) -> int:
        return self._in_flight

    @property
    def error(self) -> BaseException | None:
        return next((e.error for e in self.engines if e.error is not None), None)

    @property
    def engines(self) -> list[AsyncEngine]:
        return self.prefill + self.decode

    def start(self) -> "DisaggregatedEngine":
        for e in self.engines:
            e.start()
        return self

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()

    # -- one request -----------------------------------------------------------------------------
    @staticmethod
    def _least_loaded(pool: list[AsyncEngine]) -> AsyncEngine:
        return min(pool, key=lambda e: e.load)

    async def transfer(self, src: AsyncEngine, src_request_id: str, dst: AsyncEngine) -> KVPayload:
        """Ship a finished prefill's held K/V from `src` to `dst` as bytes; returns the payload read back.
        The export and the import each run on their engine's thread, between its steps (async_engine.py)."""
        seconds = [0.0, 0.0]  # the export's and the import's own time, not the wait for a step to end

        def timed(i: int, fn):
            t0 = time.perf_counter()
            try:
                return fn()
            finally:
                seconds[i] = time.perf_counter() - t0

        data = await src.call(lambda e: timed(0, lambda: export_kv(e, src_request_id).to_bytes()))
        payload = KVPayload.from_bytes(data)
        res = await dst.call(lambda e: timed(1, lambda: import_kv(e, payload)))
        dt = sum(seconds)
        s = self.stats
        s.num_transfers += 1
        s.num_bytes += len(data)
        s.seconds += dt
        s.num_blocks += res.num_blocks
        s.num_imported += res.num_imported
        m, labels = dst.engine.metrics, dst.engine.metric_labels
        m.kv_transfer_bytes.inc(len(data), **labels)
        m.kv_transfer_time.observe(dt, **labels)
        return payload

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        ids = list(prompt_ids)
        self.engine.check_request(ids, params)  # ValueError -> 400 before anything is queued
        rid = request_id or f"{self.model_name}-pd-{next(self._ids)}"
        self._in_flight += 1
        try:
            if params.prompt_logprobs is not None or params.max_tokens <= 1:
                # a decode engine prefills too, and counts the request under the service's name
                async for out in self._least_loaded(self.decode).generate(ids, params, rid):
                    yield out
                return
            arrival = time.monotonic()
            p = self._least_loaded(self.prefill)
            prid = f"{rid}/prefill"
            first: RequestOutput | None = None
            try:
                async for out in p.generate(ids, dataclasses.replace(params, max_tokens=1), prid, hold_kv=True):
                    first = out
                assert first is not None and first.finished
                if first.finish_reason != "length":  # EOS or a stop token: nothing left to decode
                    # the service's view; the prefill pool counted it too
                    m, labels = self.engine.metrics, self.engine.metric_labels
                    m.ttft.observe(time.monotonic() - arrival, **labels)
                    m.e2e.observe(time.monotonic() - arrival, **labels)
                    m.requests.inc(**labels, finished_reason=first.finish_reason or "stop")
                    yield dataclasses.replace(first, request_id=rid)
                    return
                d = self._least_loaded(self.decode)
                try:
                    payload = await self.transfer(p, prid, d)
                except (KVTransferError, KeyError) as e:  # the engines fit at construction: a fault, not a bad request
                    raise RuntimeError(f"K/V transfer {p.model_name} -> {d.model_name} failed: {e}") from e
            finally:
                p.call_soon(lambda e: e.release_held_kv(prid))  # a no-op once exported; frees them on an abort
            first_out = True
            prefilled = dataclasses.replace(payload.prefilled(), arrival_time=arrival)
            async for out in d.generate(ids, params, rid, prefilled=prefilled):
                if first_out:
                    d.engine.metrics.ttft.observe(time.monotonic() - arrival, **d.engine.metric_labels)
                    first_out = False
                yield out
        finally:
            self._in_flight -= 1
