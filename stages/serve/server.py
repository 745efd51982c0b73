"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

vLLM's API as a vLLM client sends it (request bodies in protocol.py): /v1/completions (text or
token-id prompts, logprobs with echo for lm-eval's local-completions, n and best_of),
/v1/chat/completions (the tokenizer's chat template over all five roles, content parts, tool calls
and a tools list; without max_tokens a chat runs to a stop or the context's end, as vLLM's does),
both with SSE streaming (logprobs in the chunks, n choices by index) and every vLLM sampling field
and prompt_logprobs, and with structured outputs (response_format, structured_outputs, guided_*)
and, on chat, tool calls parsed into `tool_calls` (structured_requests.py, tools.py); /tokenize,
/detokenize, /v1/models, /v1/models/{id}, /version, /health, /metrics (Prometheus, vLLM's names). LoRA adapters are models of their own in /v1/models (with
`parent`), named by requests' `model`; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
when runtime updating is on. Bad requests get 400 with a message (a chat the template
cannot render too, never a 500), an unknown model 404, a full queue 429, a missing or wrong API
key 401. A client that goes away has its request aborted, which
frees its KV blocks. Opt-in request logging appends prompt/completion pairs as JSON lines that the
data stage reads as a `files` source (text_field "text").
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .async_engine import AsyncEngine, EngineStopped, Overloaded
from .engine import RequestOutput
from .protocol import (ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
                       SamplingRequest, TokenizeRequest, UnloadLoRAAdapterRequest)
from .router import Router
from .sampling import SamplingParams, TokenLogprob
from .structured_requests import assistant_message, chat_finish_reason, stream_delta, tool_parser_for


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


def build_app(router: Router, api_key: str | None = None, request_log: RequestLog | None = None,
              runtime_lora_updating: bool = False):
    """`runtime_lora_updating`: serve /v1/load_lora_adapter and /v1/unload_lora_adapter. Off by
    default, as in vLLM (which adds them only under VLLM_ALLOW_RUNTIME_LORA_UPDATING): they make the
    server read any folder a client names."""
    app = FastAPI(title="eightfold serve")
    app.state.router = router
    metrics = getattr(router.primary.engine, "metrics", None)
    eng0 = router.primary.engine  # the tokenizer and context every replica shares

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        return _error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(EngineStopped)
    async def _engine_gone(_req, exc: EngineStopped):  # shut down, or its process exited: unavailable, not a bug
        return _error(503, str(exc), "server_error")

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
        # an engine core in another process keeps its metrics there (engine_core.py)
        remote = getattr(router.primary, "metrics_text", None)
        text = await remote() if remote is not None else metrics.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version():
        return {"version": _version()}

    def _card(name: str, created: int) -> dict:
        # a LoRA adapter's card as vLLM's: root its path, parent the base model it applies to
        lora = name in router.lora_names()
        return {"id": name, "object": "model", "created": created, "owned_by": "eightfold",
                "root": router.lora_path(name) if lora else name,
                "parent": router.primary.model_name if lora else None, "max_model_len": eng0.max_model_len}

    @app.get("/v1/models")
    async def models():
        now = int(time.time())
        return {"object": "list", "data": [_card(n, now) for n in router.model_names()]}

    if runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            """vLLM's endpoint: 200 and a line of text, 400 for a name taken (unless load_inplace) or an
            adapter the model cannot serve, 404 for a path with no adapter."""
            try:
                router.load_lora(body.lora_name, body.lora_path, replace=body.load_inplace)
            except FileNotFoundError:
                return _error(404, f"Loading lora {body.lora_name} failed: No adapter found for {body.lora_path}",
                              "not_found_error", "lora_path")
            except ValueError as e:
                return _error(400, str(e))
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            try:
                router.unload_lora(body.lora_name)
            except LookupError:
                return _error(404, f"The lora adapter '{body.lora_name}' cannot be found.", "not_found_error",
                              "lora_name")
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in router.model_names():
            return _error(404, f"model {model_id!r} is not served here; available: {router.model_names()}",
                          "not_found_error", "model")
        return _card(model_id, int(time.time()))

    def _render_chat(messages: list[ChatMessage], tools: list | None, add_generation_prompt: bool,
                     continue_final_message: bool, kwargs: dict | None = None) -> str:
        """The prompt as the tokenizer's chat template renders it; ValueError (a 400) naming what it cannot render."""
        msgs = [m.for_template() for m in messages]
        try:
            return eng0.tokenizer.apply_chat_template(
                msgs, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, a missing key...: the messages' fault
            raise ValueError(f"the chat template cannot render these messages: {e}") from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        try:
            router.resolve_model(body.model)
            if body.messages is not None:
                text = _render_chat(body.messages, body.tools, body.add_generation_prompt, body.continue_final_message)
            else:
                text = body.prompt or ""
            ids = eng0.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        except LookupError as e:
            return _error(404, str(e), "not_found_error", "model")
        except ValueError as e:
            return _error(400, str(e))
        out = {"count": len(ids), "max_model_len": eng0.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = eng0.tokenizer.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        try:
            router.resolve_model(body.model)
            ids = eng0.encode(body.tokens)  # checks the ids are in the vocabulary
        except LookupError as e:
            return _error(404, str(e), "not_found_error", "model")
        except ValueError as e:
            return _error(400, str(e), param="tokens")
        return {"prompt": eng0.tokenizer.decode(ids)}

    def _max_tokens(requested: int | None, ids: list[int]) -> int:
        """vLLM's rule for a request that sets no limit: generate until a stop or the context's end."""
        if requested is not None:
            return requested
        room = eng0.max_model_len - len(ids)
        if room <= 0:
            raise ValueError(f"the prompt ({len(ids)} tokens) fills the model's context length of "
                             f"{eng0.max_model_len} tokens")
        return room

    def _copies(params: SamplingParams, k: int) -> list[SamplingParams]:
        """n (or best_of) samples of one prompt; a seeded request's i-th sample uses seed + i (vLLM's rule)."""
        if k == 1:
            return [params]
        return [dataclasses.replace(params, seed=None if params.seed is None else params.seed + i) for i in range(k)]

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

    def _route(body: SamplingRequest, ids_for_affinity: list[int]) -> AsyncEngine:
        return router.choose(ids_for_affinity, router.resolve_model(body.model))

    def _token_str(tid: int, as_id: bool = False) -> str:
        return f"token_id:{tid}" if as_id else eng0.tokenizer.decode([tid])

    def _completion_logprobs(lps: list[TokenLogprob | None], ids: list[int], as_ids: bool = False) -> dict:
        """OpenAI's completion logprobs; `as_ids`: tokens as "token_id:N" (vLLM's return_tokens_as_token_ids)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = 0
        for tid, lp in zip(ids, lps):
            s = _token_str(tid)
            tokens.append(_token_str(tid, as_ids))
            offsets.append(pos)
            pos += len(s)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else {_token_str(t, as_ids): v for t, v in lp.top.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(lps: list[TokenLogprob], as_ids: bool = False) -> dict:
        def entry(tid: int, lp: float) -> dict:
            s = _token_str(tid)
            return {"token": _token_str(tid, as_ids), "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(x.token_id, x.logprob),
                             "top_logprobs": [entry(t, v) for t, v in x.top.items()]} for x in lps]}

    def _prompt_logprobs(plps: list[TokenLogprob | None]) -> list:
        """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob, rank,
        decoded_token}}, the prompt's own token and the top alternatives (ranked in order)."""
        out: list = []
        for lp in plps:
            if lp is None:
                out.append(None)
                continue
            d = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": _token_str(t)}
                 for r, (t, v) in enumerate(lp.top.items())}
            d[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": _token_str(lp.token_id)}
            out.append(d)
        return out

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
        n, k = body.n, body.best_of or body.n
        # best_of ranks the k samples by their cumulative logprob: asked for even if the client did not
        logprobs = body.logprobs if body.logprobs is not None else (0 if k > n else None)
        echo_lp = body.logprobs if body.echo and body.logprobs is not None else None
        plp = max((x for x in (body.prompt_logprobs, echo_lp) if x is not None), default=None)
        try:
            all_ids = [eng0.encode(x) for x in prompts]
            if any(not ids for ids in all_ids):
                return _error(400, "prompt must not be empty", param="prompt")
            jobs = []
            for pi, ids in enumerate(all_ids):
                base = body.sampling_params(_max_tokens(body.max_tokens, ids), logprobs, plp, eng0.vocab_size)
                eng = _route(body, ids)
                await _check(eng.engine, ids, base)
                jobs += [(pi, eng, ids, params) for params in _copies(base, k)]
        except LookupError as e:
            return _error(404, str(e), "not_found_error", "model")
        except ValueError as e:
            return _error(400, str(e))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            return await _stream(request, [(i, e, ids, sp) for i, (_, e, ids, sp) in enumerate(jobs)], rid, created,
                                 chat=False, include_usage=body.include_usage, want_logprobs=body.logprobs is not None,
                                 as_ids=body.return_tokens_as_token_ids,
                                 echo_text=prompts[0] if body.echo and isinstance(prompts[0], str) else None)
        try:
            outs = await asyncio.gather(*[_run(request, e, ids, sp) for _, e, ids, sp in jobs])
        except Overloaded as e:
            return _error(429, str(e), "rate_limit_error")
        except ValueError as e:
            return _error(400, str(e))
        choices, n_out = [], 0
        for pi, ids in enumerate(all_ids):
            mine = [(job, out) for job, out in zip(jobs, outs) if job[0] == pi]
            n_out += sum(len(out.token_ids) for _, out in mine)
            if k > n:  # best_of: the n samples the model found likeliest
                mine.sort(key=lambda jo: -sum(lp.logprob for lp in jo[1].logprobs))
            for j, ((_, eng, _, _), out) in enumerate(mine[:n]):
                text, lp = out.text, None
                if body.echo:
                    text = eng.engine.tokenizer.decode(ids) + text
                if body.logprobs is not None:
                    if body.echo:
                        lp = _completion_logprobs(list(out.prompt_logprobs) + list(out.logprobs), ids + out.token_ids,
                                                  body.return_tokens_as_token_ids)
                    else:
                        lp = _completion_logprobs(list(out.logprobs), out.token_ids, body.return_tokens_as_token_ids)
                choice = {"index": pi * n + j, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
                choices.append(choice)
                if request_log is not None:
                    request_log.write(prompt=eng.engine.tokenizer.decode(ids), completion=out.text, model=eng.model_name,
                                      endpoint="completions", finish_reason=out.finish_reason, created=created)
        n_prompt = sum(len(ids) for ids in all_ids)
        return {"id": rid, "object": "text_completion", "created": created, "model": jobs[0][1].model_name,
                "choices": choices,
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            text = _render_chat(body.messages, body.tool_dicts(), body.add_generation_prompt,
                                body.continue_final_message, body.chat_template_kwargs)
            ids = eng0.encode(text)
            top = (body.top_logprobs or 0) if body.logprobs else None
            eng = _route(body, ids)
            limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            base = body.sampling_params(_max_tokens(limit, ids), top, body.prompt_logprobs, eng0.vocab_size)
            await _check(eng.engine, ids, base)
            jobs = [(i, eng, ids, params) for i, params in enumerate(_copies(base, body.n))]
        except LookupError as e:
            return _error(404, str(e), "not_found_error", "model")
        except ValueError as e:
            return _error(400, str(e))
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            return await _stream(request, jobs, rid, created, chat=True, include_usage=body.include_usage,
                                 want_logprobs=body.logprobs, prompt_text=text, as_ids=body.return_tokens_as_token_ids,
                                 tool_parsers={i: tool_parser_for(body) for i, *_ in jobs})
        try:
            outs = await asyncio.gather(*[_run(request, e, i, sp) for _, e, i, sp in jobs])
        except Overloaded as e:
            return _error(429, str(e), "rate_limit_error")
        except ValueError as e:
            return _error(400, str(e))
        choices = []
        for i, out in enumerate(outs):
            message, finish_reason = assistant_message(body, out.text, out.finish_reason)  # tool calls parsed out
            choices.append({"index": i, "message": message,
                            "logprobs": _chat_logprobs(out.logprobs, body.return_tokens_as_token_ids) if body.logprobs
                            else None,
                            "finish_reason": finish_reason})
            if request_log is not None:
                request_log.write(prompt=text, completion=out.text, model=eng.model_name, endpoint="chat",
                                  messages=[m.model_dump() for m in body.messages], finish_reason=out.finish_reason,
                                  created=created)
        n_out = sum(len(out.token_ids) for out in outs)
        resp = {"id": rid, "object": "chat.completion", "created": created, "model": eng.model_name,
                "choices": choices,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}}
        if body.prompt_logprobs is not None:
            resp["prompt_logprobs"] = _prompt_logprobs(outs[0].prompt_logprobs)
        return resp

    async def _stream(request, jobs, rid, created, chat: bool, include_usage: bool, want_logprobs: bool,
                      echo_text: str | None = None, prompt_text: str | None = None, as_ids: bool = False,
                      tool_parsers: dict | None = None):
        """SSE chunks of every choice of a request (`jobs`: index, engine, prompt ids, params), each
        with its index, its text delta and, when asked, the logprobs of the delta's tokens.
        `tool_parsers`: a parser per choice index when tool calls are parsed out of the text (tools.py)."""
        streams = []
        try:
            for index, eng, ids, params in jobs:
                gen = eng.generate(ids, params)
                streams.append((index, gen))
                try:
                    first = await gen.__anext__()  # surfaces 429 / errors before the 200 is sent
                except StopAsyncIteration:
                    first = None
                streams[-1] = (index, gen, first)
        except Overloaded as e:
            for st in streams:
                await st[1].aclose()
            return _error(429, str(e), "rate_limit_error")
        obj = "chat.completion.chunk" if chat else "text_completion"
        eng, ids = jobs[0][1], jobs[0][2]
        # the envelope is the same for every chunk of a choice: render it once, fill in the delta
        heads = {index: 'data: {"id": %s, "object": %s, "created": %d, "model": %s, "choices": [{"index": %d, ' % (
            json.dumps(rid), json.dumps(obj), created, json.dumps(eng.model_name), index) for index, *_ in jobs}

        def chunk(index: int, delta_text: str | None, finish: str | None, role: bool = False,
                  out: RequestOutput | None = None, tool_calls: list | None = None) -> str:
            fin = json.dumps(finish)
            lp = "null"
            if want_logprobs and out is not None and out.delta_token_ids:
                new = out.delta_logprobs
                lp = json.dumps(_chat_logprobs(new, as_ids) if chat else _completion_logprobs(new, out.delta_token_ids, as_ids))
            if chat:
                delta: dict = {"role": "assistant"} if role else {}
                if delta_text is not None:
                    delta["content"] = delta_text
                if tool_calls:
                    delta["tool_calls"] = tool_calls
                body = f'"delta": {json.dumps(delta)}, "logprobs": {lp}, "finish_reason": {fin}'
            else:
                body = f'"text": {json.dumps(delta_text or "")}, "logprobs": {lp}, "finish_reason": {fin}'
            return heads[index] + body + "}]}\n\n"

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            """(choice index, output) as each choice's outputs arrive; one choice is read directly."""
            if len(streams) == 1:
                index, gen, out = streams[0]
                while out is not None:
                    yield index, out
                    if out.finished:
                        return
                    try:
                        out = await gen.__anext__()
                    except StopAsyncIteration:
                        return
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(index, gen, out):
                try:
                    while out is not None:
                        await queue.put((index, out))
                        if out.finished:
                            break
                        out = await gen.__anext__()
                except StopAsyncIteration:
                    pass
                except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
                    await queue.put((index, e))
                await queue.put((index, None))

            tasks = [asyncio.ensure_future(pump(*st)) for st in streams]
            try:
                left = len(tasks)
                while left:
                    index, out = await queue.get()
                    if out is None:
                        left -= 1
                    elif isinstance(out, BaseException):
                        raise out
                    else:
                        yield index, out
            finally:
                for t in tasks:
                    t.cancel()

        async def events() -> AsyncIterator[str]:
            last: dict[int, RequestOutput] = {}
            try:
                for index, *_ in jobs:
                    if chat:
                        yield chunk(index, "", None, role=True)
                    elif echo_text:
                        yield chunk(index, echo_text, None)
                async for index, out in outputs():
                    last[index] = out
                    parser = (tool_parsers or {}).get(index)
                    if parser is not None:  # content and tool calls parsed apart (tools.py)
                        content, calls = stream_delta(parser, out.delta_text, out.finished)
                        if content or calls or out.finished or (want_logprobs and out.delta_token_ids):
                            yield chunk(index, content if content or not calls else None,
                                        chat_finish_reason(parser, out.finish_reason) if out.finished else None,
                                        out=out, tool_calls=calls)
                    elif out.delta_text or out.finished or (want_logprobs and out.delta_token_ids):
                        yield chunk(index, out.delta_text, out.finish_reason if out.finished else None, out=out)
                if include_usage and last:
                    n = sum(len(o.token_ids) for o in last.values())
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": eng.model_name,
                                                 "choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": n,
                                                                          "total_tokens": len(ids) + n}}) + "\n\n"
                yield "data: [DONE]\n\n"
                if request_log is not None:
                    for o in last.values():
                        request_log.write(prompt=prompt_text or eng.engine.tokenizer.decode(ids), completion=o.text,
                                          model=eng.model_name, endpoint="chat" if chat else "completions",
                                          finish_reason=o.finish_reason, created=created)
            finally:
                for _, gen, _ in streams:
                    await gen.aclose()  # a disconnect lands here: aborts the request, frees its blocks

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def _check(engine, ids: list[int], params) -> None:
    """engine.check_request (ValueError: a 400), with a new grammar compiled in a worker thread
    first, so the event loop goes on streaming while it compiles (vLLM compiles apart from its loop)."""
    if params.structured_output is not None:
        await asyncio.to_thread(engine.grammar_backend().compile, params.structured_output)
    engine.check_request(ids, params)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eightfold")
    except PackageNotFoundError:
        return "unknown"


def build_router(model_dir: str, *, replicas: int = 1, canary_model_dir: str | None = None,
                 canary_share: float = 0.0, prefill_replicas: int = 0, lora_modules: dict[str, str] | None = None,
                 engine_process: bool = False, threads: int | None = None, **engine_options) -> Router:
    """Engines for a checkpoint folder (several replicas share one metrics registry) and an optional canary.
    `prefill_replicas` > 0: prefill/decode disaggregation, the `replicas` engines decode and that many
    more prefill, all behind one DisaggregatedEngine (disagg.py). `lora_modules`: name -> PEFT adapter
    folder, each served under its name (vLLM's --lora-modules). `engine_process`: the engine core steps in
    a process of its own with `threads` torch threads (engine_core.py); one replica, no canary, no
    disaggregation."""
    from .engine import EngineConfig, LLMEngine
    from .metrics import ServeMetrics
    from .router import RouterConfig

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if engine_process:
        from .engine_core import EngineCoreClient

        apart = [f"{k}={v}" for k, v, alone in (("replicas", replicas, 1), ("prefill_replicas", prefill_replicas, 0),
                                                ("canary_model_dir", canary_model_dir, None)) if v != alone]
        if apart:
            raise ValueError(f"the engine core in its own process serves one replica: {', '.join(apart)} need "
                             "engine_process off (--engine-process false)")
        client = EngineCoreClient(model_dir, EngineConfig.from_options(**engine_options), lora_modules=lora_modules,
                                  threads=threads)
        return Router([client])
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
    router = Router(fronts, canary, RouterConfig(canary_share=canary_share))
    for name, path in (lora_modules or {}).items():
        router.load_lora(name, path)
    return router


def parse_lora_modules(specs: list[str] | None) -> dict[str, str]:
    """vLLM's --lora-modules values: `name=path`, or JSON {"name": ..., "path": ...}."""
    out: dict[str, str] = {}
    for spec in specs or []:
        if spec.lstrip().startswith("{"):
            try:
                d = json.loads(spec)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {spec!r}: JSON needs \"name\" and \"path\"") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def serve_command(model_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                  request_log: str | None = None, replicas: int = 1, canary_model_dir: str | None = None,
                  canary_share: float = 0.0, prefill_replicas: int = 0, lora_modules: list[str] | None = None,
                  engine_process: bool | None = None, threads: int | None = None, **engine_options) -> int:
    """`eightfold serve MODEL_DIR`: an OpenAI-compatible server until interrupted. Returns an exit code.
    The LoRA load/unload endpoints are served when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (vLLM's switch).
    `engine_process` None: the engine core in its own process wherever it can be (one replica, no canary,
    no disaggregation), as vLLM runs it."""
    import uvicorn
    from rich.console import Console

    console = Console()
    if not (Path(model_dir) / "config.json").exists():
        console.print(f"[red]{model_dir} is not a Hugging Face checkpoint folder (no config.json)[/red]")
        return 2
    if engine_process is None:
        engine_process = replicas == 1 and not prefill_replicas and not canary_model_dir
    try:
        router = build_router(model_dir, replicas=replicas, canary_model_dir=canary_model_dir,
                              canary_share=canary_share, prefill_replicas=prefill_replicas,
                              lora_modules=parse_lora_modules(lora_modules), engine_process=engine_process,
                              threads=threads, **engine_options)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        console.print(f"[red]cannot start the engine: {e}[/red]")
        return 2
    runtime_lora = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    app = build_app(router.start(), api_key, RequestLog(request_log) if request_log else None,
                    runtime_lora_updating=runtime_lora)
    e = router.primary.engine
    hello = getattr(e, "hello", None)  # an engine core in its own process: its start-up figures
    if hello is None:
        hello = {"kv_budget": e.kv_budget.describe(e.config.block_size, e.config.max_num_seqs),
                 "kv_bytes_per_token": e.kv_bytes_per_token, "compiled": e.model.pieces.compiled,
                 "compile_seconds": e.compile_seconds}
    console.print(f"serving [bold]{e.model_name}[/bold] ({router.model_names()}) at http://{host}:{port}/v1 "
                  f"- {hello['kv_budget']} "
                  f"of kv_cache_memory_gb={e.config.kv_cache_memory_gb:g}, {hello['kv_bytes_per_token']} bytes/token; "
                  + (f"forward compiled in {hello['compile_seconds']:.1f} s; " if hello["compiled"] else "eager; ")
                  + ("engine core in its own process; " if engine_process else "")
                  + (f"{prefill_replicas} prefill engine(s) shipping K/V to {replicas} decode engine(s); "
                     if prefill_replicas else "")
                  + (f"LoRA adapters {router.lora_names()}; " if router.lora_names() else "")
                  + ("LoRA load/unload endpoints on; " if runtime_lora else "")
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
