"""The engine core in a process of its own (engine_core.py): the same tokens as the engine in process,
requests that fail loudly rather than hang when the core dies or shuts down, aborts that free the core's
requests, and the layouts it does not serve refused by name. The whole vLLM API runs against it in
test_serve_openai_api.py and the LoRA endpoints in test_serve_lora.py."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from stages.serve.async_engine import EngineDead, EngineStopped
from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.engine_core import EngineCoreClient
from stages.serve.sampling import SamplingParams
from stages.serve.server import ServerThread, build_app, build_router

PROMPTS = ["def add(a, b):", "class Point:", "import os\n", "for i in range(", "x = [", "while True:",
           "return self.", "if __name__"]
OPTIONS = dict(num_kv_blocks=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def core(tiny_hf_model_dir):
    client = EngineCoreClient(str(tiny_hf_model_dir), EngineConfig.from_options(**OPTIONS), threads=1)
    yield client
    client.shutdown()


async def _run(client, ids: list[int], params: SamplingParams) -> list:
    return [o async for o in client.generate(ids, params)]


def test_core_process_decodes_what_the_engine_in_process_does(core, tiny_hf_model_dir):
    engine = LLMEngine(str(tiny_hf_model_dir), EngineConfig.from_options(**OPTIONS))
    ids = [engine.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    want = engine.generate(ids, [greedy] * len(ids)) + engine.generate(ids[:3], [seeded] * 3)

    async def both():  # every request in flight at once: they share the core's steps
        return await asyncio.gather(*[_run(core, i, greedy) for i in ids], *[_run(core, i, seeded) for i in ids[:3]])

    got = asyncio.run(both())
    for outs, w in zip(got, want):
        last = outs[-1]
        assert last.finished and last.finish_reason == "length"
        assert last.token_ids == w.token_ids and last.text == w.text
        assert last.prompt_token_ids == w.prompt_token_ids
        # the outputs' deltas add up to the whole, as the server streams them
        assert sum((o.delta_token_ids for o in outs), []) == w.token_ids
        assert "".join(o.delta_text for o in outs) == w.text
    for outs, w in zip(got[:len(ids)], want):
        assert [lp.logprob for lp in outs[-1].logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-5)
        assert sum((o.delta_logprobs for o in outs), []) == outs[-1].logprobs


def test_a_request_left_early_is_aborted_in_the_core(core):
    async def leave_after_first():
        gen = core.generate(core.engine.encode(PROMPTS[0]), SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()  # what a client disconnect does

    asyncio.run(leave_after_first())
    assert core.load == 0
    deadline = time.monotonic() + 30
    text = ""
    while time.monotonic() < deadline:
        text = asyncio.run(core.metrics_text())
        if 'finished_reason="abort"' in text and _gauge(text, "vllm:num_requests_running") == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the core did not abort the request:\n{text}")


def _gauge(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_bad_requests_are_refused_in_the_api_process(core):
    async def one(ids, params):
        return [o async for o in core.generate(ids, params)]

    with pytest.raises(ValueError, match="context length"):
        asyncio.run(one([5] * 10, SamplingParams(max_tokens=10**6)))
    with pytest.raises(ValueError, match="not loaded"):
        asyncio.run(core.generate([5], SamplingParams(max_tokens=2), lora_name="nope").__anext__())
    with pytest.raises(ValueError, match="disaggregation"):
        asyncio.run(core.generate([5], SamplingParams(max_tokens=2), hold_kv=True).__anext__())


def test_a_core_that_dies_fails_its_requests_and_the_health_check(tiny_hf_model_dir):
    router = build_router(str(tiny_hf_model_dir), engine_process=True, threads=1, **OPTIONS).start()
    client = router.primary
    try:
        with ServerThread(build_app(router)) as srv:
            assert httpx.get(srv.url + "/health").status_code == 200

            async def killed_midway():
                gen = client.generate(client.engine.encode(PROMPTS[1]), SamplingParams(max_tokens=10**3 // 4,
                                                                                         ignore_eos=True))
                await gen.__anext__()
                os.kill(client.process.pid, signal.SIGKILL)
                async for _ in gen:
                    pass

            t0 = time.monotonic()
            with pytest.raises(EngineDead, match="engine core exited"):
                asyncio.run(asyncio.wait_for(killed_midway(), 30))
            assert time.monotonic() - t0 < 30
            health = httpx.get(srv.url + "/health")
            assert health.status_code == 503 and "engine core exited" in health.json()["error"]["message"]
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and "engine core is gone" in r.json()["error"]["message"]
    finally:
        router.shutdown()


def test_shutdown_fails_what_is_in_flight_and_stops_the_process(tiny_hf_model_dir):
    client = EngineCoreClient(str(tiny_hf_model_dir), EngineConfig.from_options(**OPTIONS), threads=1)

    async def in_flight():
        gen = client.generate(client.engine.encode(PROMPTS[2]), SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, client.shutdown)
        async for _ in gen:
            pass

    with pytest.raises(EngineStopped):
        asyncio.run(asyncio.wait_for(in_flight(), 30))
    assert not client.process.is_alive()


def test_a_core_that_cannot_start_says_why(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="engine core could not start"):
        EngineCoreClient(str(tmp_path), EngineConfig(), threads=1)


@pytest.mark.parametrize("kwargs, needle", [
    ({"replicas": 2}, "replicas=2"),
    ({"prefill_replicas": 1}, "prefill_replicas=1"),
    ({"canary_model_dir": "/elsewhere"}, "canary_model_dir=/elsewhere"),
])
def test_layouts_it_does_not_serve_are_refused_by_name(tiny_hf_model_dir, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        build_router(str(tiny_hf_model_dir), engine_process=True, **kwargs, **OPTIONS)


def _serve(model_dir, port: int):
    """`eightfold serve`'s command line in a process group of its own, as a terminal runs it."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "stages.serve.cli", "serve", str(model_dir), "--port", str(port),
                             "--threads", "1", "--enforce-eager", "--num-kv-blocks", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not start")


def _core_pids(parent: int) -> list[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if os.path.exists(f"/proc/{pid}/stat") and open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            return True  # exited, not yet reaped by its (dead) parent
        time.sleep(0.1)
    return False


def test_ctrl_c_stops_server_and_core_quietly_and_a_killed_server_takes_its_core_along(tiny_hf_model_dir):
    from stages.serve.bench import free_port

    port = free_port()
    proc = _serve(tiny_hf_model_dir, port)
    cores = _core_pids(proc.pid)
    assert cores, "eightfold serve runs its engine core in a child process by default"
    assert httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                      json={"prompt": "x", "max_tokens": 4}).json()["usage"]["completion_tokens"] == 4
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the whole group gets it
    assert proc.wait(30) == 0
    err = proc.stderr.read().decode()
    assert "Traceback" not in err, err
    assert all(_gone(pid, 10) for pid in cores)

    proc = _serve(tiny_hf_model_dir, port)
    cores = _core_pids(proc.pid)
    proc.kill()  # no shutdown at all: the core sees its pipe close and ends
    proc.wait(10)
    assert cores and all(_gone(pid, 10) for pid in cores)
