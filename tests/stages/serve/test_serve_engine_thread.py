"""The engine steps on its own thread (async_engine.py): /health answers while a long step runs, the
engine's state is changed by that thread alone, a failing step fails its requests without hanging
them (and the engine goes on), and a shutdown fails what is in flight instead of leaving it waiting."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from stages.serve.async_engine import AsyncEngine, EngineStopped
from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams
from stages.serve.server import ServerThread, build_app, build_router

STEP_S = 2.0  # the slowed step
HEALTH_LIMIT_S = 0.5  # /health must answer well inside it

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _busy_torch(seconds: float) -> None:
    """CPU work as a forward does it: torch ops (which release the GIL inside) back to back."""
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _busy_python(seconds: float) -> None:
    """CPU work that holds the GIL but for the interpreter's forced switches (every 5 ms)."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def _post_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """A completion request on a thread of its own (started); its response lands in the dict's "r"."""
    result: dict = {}
    client = threading.Thread(target=lambda: result.update(r=httpx.post(url + "/v1/completions", json=body, timeout=60)))
    client.start()
    return client, result


@pytest.mark.parametrize("slow", [_sleep, _busy_torch, _busy_python])
def test_health_answers_while_a_long_step_runs(tiny_hf_model_dir, slow):
    router = build_router(str(tiny_hf_model_dir), num_kv_blocks=64, max_num_seqs=4).start()
    runner = router.primary.engine.runner
    execute = runner.execute
    in_step, step_done = threading.Event(), threading.Event()

    def slow_execute(sched):  # the first step of the request runs STEP_S longer, inside the step
        if not in_step.is_set():
            in_step.set()
            slow(STEP_S)
            step_done.set()
        return execute(sched)

    runner.execute = slow_execute
    try:
        with ServerThread(build_app(router)) as srv:
            client, result = _post_in_background(srv.url, {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
            assert in_step.wait(30), "the request never reached a step"
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                r = httpx.get(srv.url + "/health", timeout=10)
                times.append(time.perf_counter() - t0)
                assert r.status_code == 200 and r.json() == {"status": "ok"}
            assert not step_done.is_set(), "the step ended before /health was asked: nothing was measured"
            print(f"/health during a {STEP_S} s {slow.__name__} step: {[round(t, 4) for t in times]} s")
            assert max(times) < HEALTH_LIMIT_S, f"/health took {times} s while a {STEP_S} s step ran"
            client.join(60)
            assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 4
    finally:
        router.shutdown()


def test_engine_state_is_changed_by_the_engine_thread_alone(tiny_hf_model_dir):
    eng = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=64, max_num_seqs=4))
    threads: dict[str, set[str]] = {}
    for name in ("step", "enqueue", "abort_request"):
        method = getattr(eng, name)

        def spy(*a, _name=name, _method=method, **k):
            threads.setdefault(_name, set()).add(threading.current_thread().name)
            return _method(*a, **k)

        setattr(eng, name, spy)
    front = AsyncEngine(eng)
    prompts = [eng.encode(p) for p in ("def f(x):", "import os\n", "class A:", "for i in range(3):")]

    async def run():
        async def full(p):
            return [o async for o in front.generate(p, GREEDY)][-1].token_ids

        async def leave_early(p):
            async for _ in front.generate(p, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)):
                return "left"  # closing the stream aborts the request

        return await asyncio.gather(*(full(p) for p in prompts), leave_early(prompts[0]))

    got = asyncio.run(run())
    front.shutdown()
    assert got[:4] == [o.token_ids for o in LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=64))
                       .generate(prompts, GREEDY)]
    assert set(threads) == {"step", "enqueue", "abort_request"}
    assert set().union(*threads.values()) == {f"engine-{eng.model_name}"}, threads
    assert eng.kv.num_allocated_blocks == 0 and not eng.has_unfinished()


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(tiny_hf_model_dir):
    eng = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=64, max_num_seqs=4))
    execute = eng.runner.execute
    calls = []

    def broken_once(sched):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return execute(sched)

    eng.runner.execute = broken_once
    front = AsyncEngine(eng)
    prompt = eng.encode("def f(x):")

    async def collect():
        return [o async for o in front.generate(prompt, GREEDY)]

    async def run():
        gate = threading.Event()
        front.call_soon(lambda e: gate.wait(10))  # the engine thread waits until both requests are handed over
        both = asyncio.gather(collect(), collect(), return_exceptions=True)
        await asyncio.sleep(0.2)
        gate.set()
        failed = await asyncio.wait_for(both, 30)
        again = await asyncio.wait_for(collect(), 30)
        return failed, again

    failed, again = asyncio.run(run())
    front.shutdown()
    assert all(isinstance(e, RuntimeError) and "engine step failed" in str(e) and "boom" in str(e) for e in failed)
    assert isinstance(front.error, RuntimeError)
    ref = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=64)).generate([prompt], GREEDY)[0]
    assert again[-1].token_ids == ref.token_ids
    assert eng.kv.num_allocated_blocks == 0


def test_shutdown_fails_requests_in_flight_and_a_new_request_restarts_the_thread(tiny_hf_model_dir):
    eng = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=64, max_num_seqs=4))
    front = AsyncEngine(eng)
    prompt = eng.encode("def f(x):")

    async def run():
        got = []
        with pytest.raises(EngineStopped):
            async for o in front.generate(prompt, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)):
                got.append(o)
                if len(got) == 2:  # from another thread, as a server's shutdown comes
                    threading.Thread(target=front.shutdown).start()
        return [o async for o in front.generate(prompt, GREEDY)]

    again = asyncio.run(asyncio.wait_for(run(), 60))
    front.shutdown()
    assert again[-1].finished and len(again[-1].token_ids) == GREEDY.max_tokens
    assert eng.kv.num_allocated_blocks == 0 and not eng.has_unfinished()


def test_health_answers_while_a_new_grammar_compiles(tiny_hf_model_dir):
    """A request's grammar compiles off the event loop: /health answers while it does."""
    router = build_router(str(tiny_hf_model_dir), num_kv_blocks=64, max_num_seqs=4).start()
    backend = router.primary.engine.grammar_backend()
    compile_ = backend._compile
    compiling, compiled = threading.Event(), threading.Event()

    def slow_compile(spec):
        compiling.set()
        time.sleep(STEP_S)
        compiled.set()
        return compile_(spec)

    backend._compile = slow_compile
    try:
        with ServerThread(build_app(router)) as srv:
            body = {"prompt": "x =", "max_tokens": 4, "temperature": 0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}}
            client, result = _post_in_background(srv.url, body)
            assert compiling.wait(30), "the grammar never compiled"
            t0 = time.perf_counter()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            took = time.perf_counter() - t0
            assert not compiled.is_set(), "the compile ended before /health was asked: nothing was measured"
            assert took < HEALTH_LIMIT_S, f"/health took {took:.2f} s while a grammar compiled"
            client.join(60)
            assert result["r"].status_code == 200
    finally:
        router.shutdown()
