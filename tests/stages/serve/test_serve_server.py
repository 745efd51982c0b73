"""The OpenAI-compatible server, driven by the `openai` client and raw HTTP: completions, chat,
streaming, logprobs for lm-eval, errors (400/401/404/429), metrics, request logging, and
disconnects that must leave no KV block allocated."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import openai
import pytest

from stages.serve.server import RequestLog, ServerThread, build_app, build_router


@pytest.fixture(scope="module")
def served(tiny_hf_model_dir, tmp_path_factory):
    router = build_router(str(tiny_hf_model_dir), num_kv_blocks=256, max_num_seqs=64).start()
    log = tmp_path_factory.mktemp("reqlog") / "requests.jsonl"
    with ServerThread(build_app(router, request_log=RequestLog(log))) as srv:
        yield srv, router, log
    router.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


def _wait_idle(router, timeout=30.0):
    eng = router.primary
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if eng.load == 0 and not eng.engine.has_unfinished():
            return
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: load={eng.load} unfinished={eng.engine.scheduler.num_unfinished}")


def test_openai_client_completes_chats_and_streams(client, served):
    srv, router, log = served
    name = client.models.list().data[0].id
    assert name == router.primary.model_name
    c = client.completions.create(model=name, prompt="def foo(x):", max_tokens=12, temperature=0)
    assert c.usage.completion_tokens == 12 and c.choices[0].finish_reason == "length"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=name, prompt="def foo(x):", max_tokens=12, temperature=0, stream=True))
    assert streamed == c.choices[0].text

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}]
    chat = client.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    text = chat.choices[0].message.content
    chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    # the chat template was applied: the same text through /v1/completions gives the same answer
    prompt = router.primary.engine.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert client.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0).choices[0].text == text
    _wait_idle(router)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(r["endpoint"] == "chat" and r["completion"] == text and r["text"] == r["prompt"] + text for r in records)


def test_echo_logprobs_serve_lm_eval_local_completions(client, served):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    _, router, _ = served
    eng = router.primary.engine
    ctx, cont = eng.encode("def foo(x):\n"), eng.encode("    return x")
    # the payload lm-eval sends for loglikelihood requests
    raw = httpx.post(str(client.base_url) + "completions", json={
        "model": router.primary.model_name, "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1,
        "logprobs": 1, "seed": 1234, "echo": True}).json()
    (lp, greedy), = LocalCompletionsAPI.parse_logprobs(raw, tokens=[ctx + cont], ctxlens=[len(ctx)])
    (want_lp, want_greedy), = eng_score(router, ctx, cont)
    assert lp == pytest.approx(want_lp, abs=1e-4) and greedy == want_greedy


def eng_score(router, ctx, cont):
    # the engine runs on its own thread: score through a fresh in-process engine on the same weights
    from stages.serve.engine import EngineConfig, LLMEngine

    e = LLMEngine(router.primary.engine.model_dir, EngineConfig(num_kv_blocks=64))
    return e.score([(ctx, cont)])


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": 10**7}, "context length"),
    ({"prompt": [[10**8]]}, "vocabulary"),
])
def test_bad_completion_requests_get_400_with_a_message(served, body, needle):
    r = httpx.post(served[0].url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_chat_requests_and_unknown_model(served, client):
    url = served[0].url + "/v1/chat/completions"
    assert httpx.post(url, json={"messages": []}).status_code == 400
    assert httpx.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    assert httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served[1].primary.model_name, messages=[{"role": "user", "content": "x"}],
                                       top_p=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_metrics_and_health(served, client):
    srv, router, _ = served
    client.completions.create(model=router.primary.model_name, prompt="import os", max_tokens=4, temperature=0)
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    text = httpx.get(srv.url + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_sum", "vllm:request_queue_time_seconds_count",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:request_time_per_output_token_seconds_count"):
        assert name in text, name
    ttft = [line for line in text.splitlines() if line.startswith("vllm:time_to_first_token_seconds_count")]
    assert ttft and float(ttft[0].split()[-1]) > 0
    assert f'model_name="{router.primary.model_name}"' in ttft[0] and 'engine="0"' in ttft[0]


def test_api_key(tiny_hf_model_dir, served):
    app = build_app(served[1], api_key="s3cret")
    with ServerThread(app) as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert c.completions.create(model=served[1].primary.model_name, prompt="x", max_tokens=2).choices


def test_overload_gets_429(tiny_hf_model_dir):
    router = build_router(str(tiny_hf_model_dir), num_kv_blocks=64, max_num_seqs=1, max_waiting=0).start()
    try:
        with ServerThread(build_app(router)) as srv:
            body = {"prompt": "def", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body) as first:
                assert first.status_code == 200
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 429 and "overloaded" in r.json()["error"]["message"]
            # the first stream was closed early: its request is aborted and its blocks freed
            _wait_idle(router)
            assert router.primary.engine.kv.num_allocated_blocks == 0
    finally:
        router.shutdown()


@pytest.mark.slow
def test_200_concurrent_requests_with_random_disconnects_leave_no_block_allocated(served):
    srv, router, _ = served
    eng = router.primary.engine
    aborted_before = eng.metrics.requests.value(model_name=eng.model_name, finished_reason="abort")
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": f"def f{i}(x):\n    return x * {i}", "max_tokens": rng.randint(8, 200), "ignore_eos": True,
                "temperature": 0.7, "seed": i, "stream": i % 2 == 0}
        # half the clients go away at a random moment: before, during or after their answer; every
        # fourth streams far more tokens than it will wait for and leaves after its first chunk, so the
        # server surely holds the request when it leaves (on a slow machine a timed leave can come before
        # the server has even read the request, which frees nothing and aborts nothing)
        disconnect_after = rng.random() * 0.5 if rng.random() < 0.5 else None
        if i % 4 == 0:
            body.update(max_tokens=1000, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return "disconnected"  # leaving the block closes the connection mid-answer
            return "done"
        try:
            async with asyncio.timeout(disconnect_after):
                if body["stream"]:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            pass
                else:
                    r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200
                return "done"
        except TimeoutError:
            return "disconnected"

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*[one(client, i) for i in range(200)])

    results = asyncio.run(main())
    assert results.count("disconnected") > 20 and results.count("done") > 20
    _wait_idle(router)
    assert eng.kv.num_allocated_blocks == 0
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.scheduler.requests
    assert eng.metrics.requests.value(model_name=eng.model_name, finished_reason="abort") > aborted_before
