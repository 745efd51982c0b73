"""The engine core in a process of its own, the API server in another (vLLM V1's layout).

In one process the engine's steps and the HTTP work (uvicorn, starlette, each streamed chunk) share one
interpreter and its GIL: measured on 2 cores, the served load kept 0.6-0.85 of what the same engine makes
without HTTP; in this layout it keeps 0.96-0.99 (benchmarks/serve_throughput.py). Here the core process does nothing but step: it reads requests and aborts from a pipe
between two steps and writes each step's outputs back as one message; the API process keeps everything
else (tokenising, chat templates, request checks, grammar checks, streaming).

The wire carries only what is new: per output the request id, the new token ids, text and logprobs, and
the finish; `EngineCoreClient` rebuilds each request's cumulative `RequestOutput` (vLLM's output
processor does the same on its side). Metrics live where they are observed, in the core: /metrics asks
the core for its text. LoRA adapters are loaded there too; the API process keeps their names and paths.

`EngineCoreClient` has AsyncEngine's face (`generate`, `abort`, `load`, `model_name`, `error`, `start`,
`shutdown`, and `engine`: an `EngineFront` with the tokenizer, the context length and the checks), so the
router and the server take either. Not served this way: prefill/decode disaggregation, several replicas
and a canary (each needs engines the API process reaches in place); build_router refuses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from .async_engine import EngineDead, EngineStopped, Overloaded, _hand_back, _settle, stream_outputs
from .engine import EngineConfig, RequestChecks, RequestOutput
from .sampling import SamplingParams

log = logging.getLogger(__name__)

_POLL_S = 1.0  # an idle core checks this often whether its API process is still there
_START_TIMEOUT_S = 600.0  # loading and compiling a model may take minutes


# -- the core process --------------------------------------------------------------------------------
def _wire(o: RequestOutput, first: bool) -> tuple:
    """One output as the core sends it: what is new since the previous one."""
    return (o.request_id, o.delta_token_ids, o.delta_text, o.finished, o.finish_reason, o.delta_logprobs,
            o.num_cached_tokens, o.prompt_logprobs if first else None)


def _core_main(model_dir: str, config: EngineConfig, lora_modules: dict[str, str], threads: int | None,
               requests, outputs) -> None:
    """The core process: build the engine, say hello, then step while anything is unfinished and
    handle what the API process sends between steps. It ends when told to, or when the API process
    is gone (its pipe closes)."""
    import signal

    # Ctrl-C reaches the whole process group: the API process decides when the core stops (as vLLM's)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve_core(model_dir, config, lora_modules, threads, requests, outputs)
    except (BrokenPipeError, EOFError, ConnectionResetError):  # the API process went away mid-message
        pass


def _serve_core(model_dir: str, config: EngineConfig, lora_modules: dict[str, str], threads: int | None,
                requests, outputs) -> None:
    import torch

    from .engine import LLMEngine

    if threads:
        torch.set_num_threads(threads)
    try:
        engine = LLMEngine(model_dir, config)
        for name, path in lora_modules.items():
            engine.load_lora(name, path)
    except BaseException as e:  # noqa: BLE001 - the API process reports it and exits
        outputs.send(("failed", f"{type(e).__name__}: {e}"))
        return
    outputs.send(("ready", {
        "model_name": engine.model_name, "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
        "eos_token_ids": sorted(engine.eos_token_ids),
        "loras": {n: a.path for n, a in engine.loras.items()}, "compile_seconds": engine.compile_seconds,
        "compiled": engine.model.pieces.compiled, "kv_bytes_per_token": engine.kv_bytes_per_token,
        "kv_budget": engine.kv_budget.describe(config.block_size, config.max_num_seqs)}))
    started: set[str] = set()  # requests whose first output went out (it carries the prompt logprobs)

    def handle(msg: tuple) -> bool:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params, lora_name = msg
            try:
                engine.add_request(ids, params, rid, lora_name=lora_name)
            except Exception as e:  # noqa: BLE001 - that request fails, the others go on
                outputs.send(("fail", rid, f"{type(e).__name__}: {e}"))
        elif kind == "abort":
            started.discard(msg[1])
            engine.abort_request(msg[1])
        elif kind == "rejected":
            engine.metrics.rejected.inc(**engine.metric_labels)
        elif kind == "call":
            _, cid, name, args = msg
            try:
                result, error = _CALLS[name](engine, *args), None
            except Exception as e:  # noqa: BLE001 - raised again in the API process
                result, error = None, e
            outputs.send(("result", cid, result, error))
        elif kind == "stop":
            return False
        return True

    while True:
        if not engine.has_unfinished() and not requests.poll(_POLL_S):
            continue
        try:
            while requests.poll():
                if not handle(requests.recv()):
                    return
        except EOFError:  # the API process is gone
            return
        if engine.has_unfinished():
            try:
                outs = engine.step()
            except Exception as e:  # noqa: BLE001 - every request fails rather than hang
                log.error("engine step failed\n%s", traceback.format_exc())  # the server's stderr
                outputs.send(("dead", f"engine step failed: {e!r}"))
                return
            if outs:
                wire = []
                for o in outs:
                    wire.append(_wire(o, o.request_id not in started))
                    if o.finished:
                        started.discard(o.request_id)
                    else:
                        started.add(o.request_id)
                outputs.send(("out", wire))


def _load_lora(engine, name: str, path: str, replace: bool) -> str:
    engine.load_lora(name, path, replace=replace)
    return engine.loras[name].path


_CALLS = {
    "metrics": lambda engine: engine.metrics.render(),
    "load_lora": _load_lora,
    "unload_lora": lambda engine, name: engine.unload_lora(name),
}


# -- the API process's side ----------------------------------------------------------------------------
@dataclass
class _Adapter:
    path: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)

    def output(self, w: tuple) -> RequestOutput:
        rid, new_ids, new_text, finished, reason, new_lps, cached, prompt_lps = w
        self.token_ids = self.token_ids + new_ids  # a new list: an output already handed out keeps its own
        self.text += new_text
        if new_lps:
            self.logprobs = self.logprobs + new_lps
        if prompt_lps is not None:
            self.prompt_logprobs = prompt_lps
        return RequestOutput(rid, self.prompt_ids, self.token_ids, self.text, new_text, new_ids, finished, reason,
                             self.logprobs, self.prompt_logprobs, cached, new_lps)


class EngineFront(RequestChecks):
    """What the API process knows of the engine without holding it: tokenizer, context length,
    vocabulary, the request checks, the LoRA adapters' names, and the core's start-up figures."""

    def __init__(self, model_dir: str, config: EngineConfig, hello: dict[str, Any], client: "EngineCoreClient"):
        from transformers import AutoTokenizer

        self.config, self.model_dir = config, Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model_name = hello["model_name"]
        self.max_model_len, self.vocab_size = hello["max_model_len"], hello["vocab_size"]
        self.eos_token_ids = frozenset(hello["eos_token_ids"])
        self.loras = {n: _Adapter(p) for n, p in hello["loras"].items()}
        self.hello = hello
        self._grammar_backend = None
        self._client = client

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        self.loras[name] = _Adapter(self._client.call_blocking("load_lora", name, path, replace))

    def unload_lora(self, name: str) -> None:
        self._client.call_blocking("unload_lora", name)
        self.loras.pop(name, None)


class EngineCoreClient:
    """AsyncEngine's face over an engine core process (see the module's docstring)."""

    def __init__(self, model_dir: str, config: EngineConfig, *, lora_modules: dict[str, str] | None = None,
                 threads: int | None = None, start_timeout: float = _START_TIMEOUT_S):
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copy of this process's threads or torch state
        requests_r, self._requests = ctx.Pipe(duplex=False)
        self._outputs, outputs_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_core_main, name="engine-core", daemon=True,
                                   args=(str(model_dir), config, dict(lora_modules or {}), threads, requests_r,
                                         outputs_w))
        self.process.start()
        requests_r.close()
        outputs_w.close()
        self.error: BaseException | None = None
        if not self._outputs.poll(start_timeout):
            self.process.kill()
            raise RuntimeError(f"the engine core did not start within {start_timeout:.0f} s")
        try:
            hello = self._outputs.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine core exited while starting (exit code {self.process.exitcode})") from None
        if hello[0] != "ready":
            self.process.join(5)
            raise ValueError(f"the engine core could not start: {hello[1]}")
        self.engine = EngineFront(model_dir, config, hello[1], self)
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, Callable[[Any, BaseException | None], None]] = {}  # call id -> settle(result, error)
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def load(self) -> int:
        return len(self._streams)

    def start(self) -> "EngineCoreClient":
        return self

    def _send(self, msg: tuple) -> None:
        if self.error is not None:
            raise EngineDead(f"the engine core is gone: {self.error}")
        with self._send_lock:
            self._requests.send(msg)

    # -- calls into the core (between two of its steps) ----------------------------------------------------
    def _call(self, name: str, args: tuple, settle) -> None:
        cid = next(self._ids)
        self._calls[cid] = settle
        try:
            self._send(("call", cid, name, args))
        except BaseException:
            self._calls.pop(cid, None)
            raise

    async def call(self, name: str, *args) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result, error):
            loop.call_soon_threadsafe(_settle, fut, result, error)

        self._call(name, args, settle)
        return await fut

    def call_blocking(self, name: str, *args, timeout: float = 60.0) -> Any:
        done = threading.Event()
        box: list = []

        def settle(result, error):
            box.extend((result, error))
            done.set()

        self._call(name, args, settle)
        if not done.wait(timeout):
            raise TimeoutError(f"the engine core did not answer {name!r} within {timeout:.0f} s")
        if box[1] is not None:
            raise box[1]
        return box[0]

    async def metrics_text(self) -> str:
        return await self.call("metrics")

    # -- requests -------------------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None, *,
                       hold_kv: bool = False, prefilled=None, lora_name: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        if hold_kv or prefilled is not None:
            raise ValueError("prefill/decode disaggregation is not served with the engine core in its own process")
        ids = list(prompt_ids)
        self.engine.check_request(ids, params)  # ValueError -> 400 before anything is sent
        if lora_name is not None and lora_name not in self.engine.loras:
            raise ValueError(f"LoRA adapter {lora_name!r} is not loaded")
        cfg = self.engine.config
        if len(self._streams) >= cfg.max_waiting + cfg.max_num_seqs:
            self._send(("rejected",))
            raise Overloaded(f"server overloaded: {len(self._streams)} requests in flight")
        rid = request_id or f"{self.model_name}-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), ids)
        self._streams[rid] = stream
        try:
            self._send(("add", rid, ids, params, lora_name))
        except BaseException:
            self._streams.pop(rid, None)
            raise
        async with contextlib.aclosing(stream_outputs(stream.queue, lambda done: self._leave(rid, done))) as outs:
            async for out in outs:
                yield out

    def _leave(self, rid: str, finished: bool) -> None:
        self._streams.pop(rid, None)
        if not finished:
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self.error is None and not self._closed:
            try:
                self._send(("abort", request_id))
            except (OSError, RuntimeError):
                pass

    # -- the reader thread: the core's messages to the loops that wait on them ----------------------------
    def _read(self) -> None:
        try:
            while True:
                msg = self._outputs.recv()
                kind = msg[0]
                if kind == "out":
                    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                    for w in msg[1]:
                        stream = self._streams.get(w[0])
                        if stream is not None:
                            by_loop.setdefault(stream.loop, []).append((stream.queue, stream.output(w)))
                    for loop, items in by_loop.items():
                        _hand_back(loop, items)
                elif kind == "fail":
                    stream = self._streams.get(msg[1])
                    if stream is not None:
                        _hand_back(stream.loop, [(stream.queue, RuntimeError(f"the engine could not queue the "
                                                                              f"request: {msg[2]}"))])
                elif kind == "result":
                    settle = self._calls.pop(msg[1], None)
                    if settle is not None:
                        settle(msg[2], msg[3])
                elif kind == "dead":
                    raise RuntimeError(msg[1])
        except (EOFError, OSError) as e:
            if not self._closed:
                self.process.join(1)
                self._fail_all(EngineDead(f"the engine core exited (exit code {self.process.exitcode}): {e!r}"))
        except BaseException as e:  # noqa: BLE001 - a step that failed ("dead"), or a message we could not read
            self._fail_all(EngineDead(str(e) if isinstance(e, RuntimeError) else repr(e)))

    def _fail_all(self, error: BaseException) -> None:
        self.error = error
        streams, self._streams = self._streams, {}
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in streams.values():
            by_loop.setdefault(stream.loop, []).append((stream.queue, error))
        for loop, items in by_loop.items():
            _hand_back(loop, items)
        calls, self._calls = self._calls, {}
        for settle in calls.values():
            settle(None, error)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core after its step; requests in flight fail with EngineStopped."""
        if self._closed:
            return
        self._closed = True
        try:
            with self._send_lock:
                self._requests.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._fail_all(EngineStopped(f"engine {self.model_name} was shut down"))
        self._requests.close()
