"""The engine driven from asyncio: one task in the server's event loop alternates an engine step
with a turn of the loop (network I/O, streaming the step's tokens out).

Running the step in the loop's own thread rather than a second thread is deliberate: two Python
threads fight over the GIL once per torch op (hundreds per step) and each hand-over can wait the
interpreter's 5 ms switch interval, which multiplied the inter-token latency several-fold. Here
nothing contends; the loop simply waits while a step runs, as it would for any other CPU work."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import AsyncIterator, Sequence

from .engine import LLMEngine, PrefilledRequest, RequestOutput
from .sampling import SamplingParams


class Overloaded(RuntimeError):
    """Too many requests in flight: the server answers 429."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.error: BaseException | None = None

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def load(self) -> int:
        """Requests not yet finished."""
        return len(self._queues)

    def start(self) -> "AsyncEngine":
        """The loop task starts with the first request, in the loop that serves it."""
        return self

    def shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            try:
                self._task.get_loop().call_soon_threadsafe(self._task.cancel)
            except RuntimeError:  # the loop is already closed
                pass
        self._task = None

    def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name=f"engine-{self.model_name}")

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, *, hold_kv: bool = False,
                       prefilled: PrefilledRequest | None = None,
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield outputs as they come; leaving early (a client disconnect) aborts the request.
        `hold_kv` and `prefilled`: the prefill and the decode side of a disaggregated request
        (`LLMEngine.add_request`, `LLMEngine.add_prefilled_request`; disagg.py). `lora_name`: the
        LoRA adapter it runs with."""
        ids = list(prompt_ids)
        self.engine.check_request(ids, params)  # ValueError -> 400 before anything is queued
        cfg = self.engine.config
        if len(self._queues) >= cfg.max_waiting + cfg.max_num_seqs:
            self.engine.metrics.rejected.inc(**self.engine.metric_labels)
            raise Overloaded(f"server overloaded: {len(self._queues)} requests in flight")
        rid = request_id or f"{self.model_name}-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        if prefilled is not None:
            if lora_name is not None:
                raise ValueError("LoRA adapters are not served with prefill/decode disaggregation")
            first = self.engine.add_prefilled_request(ids, params, rid, prefilled)
            q.put_nowait(first)
            if not first.finished:
                self._queues[rid] = q
        else:
            try:
                self.engine.add_request(ids, params, request_id=rid, hold_kv=hold_kv, lora_name=lora_name)
            except LookupError as e:  # unloaded since the server resolved the name: the request's fault, a 400
                raise ValueError(str(e)) from None
            self._queues[rid] = q
        self._ensure_running()
        self._wake.set()
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.engine.abort_request(request_id)

    async def _run(self) -> None:
        eng = self.engine
        off_main = threading.current_thread() is not threading.main_thread()  # see the end of the loop
        while True:
            if not eng.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail every request rather than hang them
                self.error = e
                for rid, q in list(self._queues.items()):
                    eng.abort_request(rid)
                    q.put_nowait(RuntimeError(f"engine step failed: {e!r}"))
                self._queues.clear()
                continue
            for o in outputs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)
                    if o.finished:
                        del self._queues[o.request_id]
            # a server on a background thread (ServerThread: tests, `--server thread`) shares the
            # process with its caller: a step holds the GIL for most of its Python bookkeeping, and
            # without a blocking call here the next step starts before the caller's thread is
            # scheduled. Not in the main thread (`eightfold serve`, the in-process benchmark), where
            # other threads are idle helpers (tqdm's monitor...): the call also yields the CPU, which
            # on a busy machine hands the core to another process for a time slice, every step
            if off_main:
                time.sleep(0)
            await asyncio.sleep(0)  # one turn of the loop: stream these tokens, take new requests
