"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

/v1/completions (text or token-id prompts, logprobs with echo for lm-eval's local-completions),
/v1/chat/completions (the tokenizer's chat template), both with SSE streaming and with structured
outputs (response_format, structured_outputs, guided_*) and, on chat, tool calls
(structured_requests.py); /v1/models,
/health, /metrics (Prometheus). Bad requests get 400 with a message, an unknown model 404, a full
queue 429, a missing or wrong API key 401. A client that goes away has its request aborted, which
frees its KV blocks. Opt-in request logging appends prompt/completion pairs as JSON lines that the
data stage reads as a `files` source (text_field "text").
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .async_engine import AsyncEngine, Overloaded
from .engine import RequestOutput
from .router import Router
from .sampling import SamplingParams, TokenLogprob
from .structured_requests import (StructuredOutputFields, ToolFields, assistant_message, chat_finish_reason,
                                  stream_delta, structured_output_of, tool_parser_for)


class _Common(StructuredOutputFields):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Common, ToolFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=0)


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


class RequestLog:
    """Appends {"prompt", "completion", "text", ...} lines to a JSONL file (opt-in)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def write(self, **record: Any) -> None:
        record["text"] = record.get("prompt", "") + record.get("completion", "")
        line = json.dumps(record, ensure_ascii=False)
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")


class APIKeyMiddleware:
    """401 for /v1/* without `Authorization: Bearer <key>`. Plain ASGI on purpose: FastAPI's
    @app.middleware("http") pipes every streamed chunk through extra memory streams."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await _error(401, "missing or invalid API key", "authentication_error")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(router: Router, api_key: str | None = None, request_log: RequestLog | None = None):
    app = FastAPI(title="eightfold serve")
    app.state.router = router
    metrics = router.primary.engine.metrics

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return _error(400, "; ".join(parts) or "invalid request")

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health():
        errors = [repr(e.error) for e in router.engines if e.error is not None]
        if errors:
            return _error(503, f"engine failed: {errors[0]}", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [{"id": n, "object": "model", "created": now, "owned_by": "eightfold"}
                                           for n in router.model_names()]}

    def _params(body: _Common, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None):
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            stop=stop, stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_output=structured_output_of(body),
        )

    async def _run(request: Request, engine: AsyncEngine, ids: list[int], params: SamplingParams) -> RequestOutput:
        """Collect a whole generation, aborting it if the client disconnects meanwhile."""

        async def consume():
            last = None
            async for out in engine.generate(ids, params):
                last = out
            return last

        task = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.1)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()  # the generator's cleanup aborts the request
                    raise asyncio.CancelledError()
        finally:
            if not task.done():
                task.cancel()

    def _route(body: _Common, ids_for_affinity: list[int]) -> AsyncEngine:
        return router.choose(ids_for_affinity, router.resolve_model(body.model))

    def _token_str(engine: AsyncEngine, tid: int) -> str:
        return engine.engine.tokenizer.decode([tid])

    def _completion_logprobs(engine: AsyncEngine, lps: list[TokenLogprob | None], ids: list[int]) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = 0
        for tid, lp in zip(ids, lps):
            s = _token_str(engine, tid)
            tokens.append(s)
            offsets.append(pos)
            pos += len(s)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {_token_str(engine, t): v for t, v in lp.top.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        p = body.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif isinstance(p, list) and p and isinstance(p[0], int):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if body.stream and len(prompts) != 1:
            return _error(400, "streaming supports a single prompt", param="prompt")
        try:
            eng0 = router.primary.engine
            all_ids = [eng0.encode(x) for x in prompts]
            if any(not ids for ids in all_ids):
                return _error(400, "prompt must not be empty", param="prompt")
            params = _params(body, body.max_tokens, body.logprobs,
                             body.logprobs if body.echo and body.logprobs is not None else None)
            targets = [_route(body, ids) for ids in all_ids]
            for eng, ids in zip(targets, all_ids):
                eng.engine.check_request(ids, params)
        except LookupError as e:
            return _error(404, str(e), "not_found_error", "model")
        except ValueError as e:
            return _error(400, str(e))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            eng, ids = targets[0], all_ids[0]
            return await _stream(request, eng, ids, params, rid, created, chat=False,
                                 include_usage=bool((body.stream_options or {}).get("include_usage")),
                                 echo_text=prompts[0] if body.echo and isinstance(prompts[0], str) else None)
        try:
            outs = await asyncio.gather(*[_run(request, e, ids, params) for e, ids in zip(targets, all_ids)])
        except Overloaded as e:
            return _error(429, str(e), "rate_limit_error")
        except ValueError as e:
            return _error(400, str(e))
        choices, n_prompt, n_out = [], 0, 0
        for i, (eng, ids, out) in enumerate(zip(targets, all_ids, outs)):
            text = out.text
            lp = None
            if body.echo:
                text = eng.engine.tokenizer.decode(ids) + text
            if body.logprobs is not None:
                if body.echo:
                    lps = list(out.prompt_logprobs) + list(out.logprobs)
                    lp = _completion_logprobs(eng, lps, ids + out.token_ids)
                else:
                    lp = _completion_logprobs(eng, list(out.logprobs), out.token_ids)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason})
            n_prompt += len(ids)
            n_out += len(out.token_ids)
            if request_log is not None:
                request_log.write(prompt=eng.engine.tokenizer.decode(ids), completion=out.text, model=eng.model_name,
                                  endpoint="completions", finish_reason=out.finish_reason, created=created)
        return {"id": rid, "object": "text_completion", "created": created, "model": targets[0].model_name,
                "choices": choices,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            eng0 = router.primary.engine
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = eng0.tokenizer.apply_chat_template([m.model_dump() for m in body.messages], tools=tools,
                                                       tokenize=False, add_generation_prompt=True)
            ids = eng0.encode(text)
            top = (body.top_logprobs or 0) if body.logprobs else None
            params = _params(body, body.max_completion_tokens or body.max_tokens, top, None)
            eng = _route(body, ids)
            eng.engine.check_request(ids, params)
        except LookupError as e:
            return _error(404, str(e), "not_found_error", "model")
        except ValueError as e:
            return _error(400, str(e))
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            return await _stream(request, eng, ids, params, rid, created, chat=True,
                                 include_usage=bool((body.stream_options or {}).get("include_usage")), prompt_text=text,
                                 tool_parser=tool_parser_for(body))
        try:
            out = await _run(request, eng, ids, params)
        except Overloaded as e:
            return _error(429, str(e), "rate_limit_error")
        except ValueError as e:
            return _error(400, str(e))
        lp = None
        if body.logprobs:
            lp = {"content": [{"token": _token_str(eng, x.token_id), "logprob": x.logprob,
                               "top_logprobs": [{"token": _token_str(eng, t), "logprob": v} for t, v in x.top.items()]}
                              for x in out.logprobs]}
        if request_log is not None:
            request_log.write(prompt=text, completion=out.text, model=eng.model_name, endpoint="chat",
                              messages=[m.model_dump() for m in body.messages], finish_reason=out.finish_reason,
                              created=created)
        message, finish_reason = assistant_message(body, out.text, out.finish_reason)
        return {"id": rid, "object": "chat.completion", "created": created, "model": eng.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish_reason}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
                          "total_tokens": len(ids) + len(out.token_ids)}}

    async def _stream(request, eng: AsyncEngine, ids, params, rid, created, chat: bool, include_usage: bool,
                      echo_text: str | None = None, prompt_text: str | None = None, tool_parser=None):
        gen = eng.generate(ids, params)
        try:
            first = await gen.__anext__()  # surfaces 429 / errors before the 200 is sent
        except Overloaded as e:
            await gen.aclose()
            return _error(429, str(e), "rate_limit_error")
        except StopAsyncIteration:
            first = None
        obj = "chat.completion.chunk" if chat else "text_completion"

        # the envelope is the same for every chunk of a stream: render it once, fill in the delta
        head = 'data: {"id": %s, "object": %s, "created": %d, "model": %s, "choices": [{"index": 0, ' % (
            json.dumps(rid), json.dumps(obj), created, json.dumps(eng.model_name))

        def chunk(delta_text: str | None, finish: str | None, role: bool = False, tool_calls: list | None = None) -> str:
            fin = json.dumps(finish)
            if chat:
                delta: dict = {"role": "assistant"} if role else {}
                if delta_text is not None:
                    delta["content"] = delta_text
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                body = f'"delta": {json.dumps(delta)}, "logprobs": null, "finish_reason": {fin}'
            else:
                body = f'"text": {json.dumps(delta_text or "")}, "logprobs": null, "finish_reason": {fin}'
            return head + body + "}]}\n\n"

        async def events() -> AsyncIterator[str]:
            last = first
            try:
                if chat:
                    yield chunk("", None, role=True)
                elif echo_text:
                    yield chunk(echo_text, None)
                out = first
                while out is not None:
                    last = out
                    if tool_parser is not None:  # content and tool calls parsed apart (tools.py)
                        content, calls = stream_delta(tool_parser, out.delta_text, out.finished)
                        if content or calls or out.finished:
                            yield chunk(content if content or not calls else None,
                                        chat_finish_reason(tool_parser, out.finish_reason) if out.finished else None,
                                        tool_calls=calls)
                    elif out.delta_text or out.finished:
                        yield chunk(out.delta_text, out.finish_reason if out.finished else None)
                    if out.finished:
                        break
                    out = await gen.__anext__()
                if include_usage and last is not None:
                    n = len(last.token_ids)
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": eng.model_name,
                                                 "choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                                                                          "total_tokens": len(ids) + n}}) + "\n\n"
                yield "data: [DONE]\n\n"
                if request_log is not None and last is not None:
                    request_log.write(prompt=prompt_text or eng.engine.tokenizer.decode(ids), completion=last.text,
                                      model=eng.model_name, endpoint="chat" if chat else "completions",
                                      finish_reason=last.finish_reason, created=created)
            finally:
                await gen.aclose()  # a disconnect lands here: aborts the request, frees its blocks

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def build_router(model_dir: str, *, replicas: int = 1, canary_model_dir: str | None = None,
                 canary_share: float = 0.0, prefill_replicas: int = 0, **engine_options) -> Router:
    """Engines for a checkpoint folder (several replicas share one metrics registry) and an optional canary.
    `prefill_replicas` > 0: prefill/decode disaggregation, the `replicas` engines decode and that many
    more prefill, all behind one DisaggregatedEngine (disagg.py)."""
    from .engine import EngineConfig, LLMEngine
    from .metrics import ServeMetrics
    from .router import RouterConfig

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    metrics = ServeMetrics()
    cfg = EngineConfig.from_options(**engine_options)
    first = LLMEngine(model_dir, cfg, metrics=metrics)
    engines = [first] + [LLMEngine(model_dir, cfg, tokenizer=first.tokenizer, metrics=metrics) for _ in range(replicas - 1)]
    if prefill_replicas < 0:
        raise ValueError(f"prefill_replicas must be >= 0, got {prefill_replicas}")
    fronts: list = [AsyncEngine(e) for e in engines]
    if prefill_replicas:
        from .disagg import DisaggregatedEngine, prefill_engine_config

        pcfg = prefill_engine_config(cfg, first.model_name)
        prefill = [LLMEngine(model_dir, pcfg, tokenizer=first.tokenizer, metrics=metrics) for _ in range(prefill_replicas)]
        fronts = [DisaggregatedEngine([AsyncEngine(e) for e in prefill], fronts)]
    canary = None
    if canary_model_dir:
        ccfg = EngineConfig.from_options(**{**engine_options, "served_model_name": Path(canary_model_dir).name
                                            if Path(canary_model_dir).name != first.model_name else first.model_name + "-canary"})
        canary = AsyncEngine(LLMEngine(canary_model_dir, ccfg, metrics=metrics))
    return Router(fronts, canary, RouterConfig(canary_share=canary_share))


def serve_command(model_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                  request_log: str | None = None, replicas: int = 1, canary_model_dir: str | None = None,
                  canary_share: float = 0.0, prefill_replicas: int = 0, **engine_options) -> int:
    """`eightfold serve MODEL_DIR`: an OpenAI-compatible server until interrupted. Returns an exit code."""
    import uvicorn
    from rich.console import Console

    console = Console()
    if not (Path(model_dir) / "config.json").exists():
        console.print(f"[red]{model_dir} is not a Hugging Face checkpoint folder (no config.json)[/red]")
        return 2
    try:
        router = build_router(model_dir, replicas=replicas, canary_model_dir=canary_model_dir,
                              canary_share=canary_share, prefill_replicas=prefill_replicas, **engine_options)
    except (ValueError, FileNotFoundError, KeyError) as e:
        console.print(f"[red]cannot start the engine: {e}[/red]")
        return 2
    app = build_app(router.start(), api_key, RequestLog(request_log) if request_log else None)
    e = router.primary.engine
    console.print(f"serving [bold]{e.model_name}[/bold] ({router.model_names()}) at http://{host}:{port}/v1 "
                  f"- {e.kv.pool.num_blocks} KV blocks of {e.config.block_size} tokens, "
                  f"{e.kv_bytes_per_token} bytes/token; "
                  + (f"forward compiled in {e.compile_seconds:.1f} s; " if e.model.pieces.compiled else "eager; ")
                  + (f"{prefill_replicas} prefill engine(s) shipping K/V to {replicas} decode engine(s); "
                     if prefill_replicas else "")
                  + "metrics at /metrics")
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        router.shutdown()
    return 0


class ServerThread:
    """Run an app with uvicorn on a background thread, on a free port (tests, the benchmark)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
