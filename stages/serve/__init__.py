"""The serving engine (seed chapter "serving"): a paged KV cache over a block pool with prefix
caching (kv_cache.py), requests (request.py) and a scheduler that is pure bookkeeping over a
per-step token budget (scheduler.py), a paged-attention Llama forward over a Hugging Face checkpoint
(model.py; one pass through its layers, run eagerly or compiled whole: layer_pass.py, compiled_forward.py;
the attention of a step's groups of sequences: attention.py, decode attention on CPU by our C kernel:
slot_kernel.py; mixture-of-experts layers of Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints: moe.py; INT4
pack-quantized, INT8 W8A8 and GGUF Q8_0/Q4_0 weights stay packed in memory: quant_linear.py,
gguf_loader.py; PEFT LoRA adapters applied per row of the batch: lora.py), contiguous K/V rows that
decoding requests read in place
(decode_slots.py), the runner that turns one scheduled step into one forward (runner.py), sampling and
logprobs (sampling.py), speculative decoding with exact rejection sampling (speculative.py), the
engine and its in-process API for evaluation and RL rollouts (engine.py), its asyncio driver
(async_engine.py), an OpenAI-compatible HTTP server (server.py) with structured outputs (a grammar per
request and a token bitmask per step with xgrammar: structured_output.py), tool calls (their format,
grammar and parser: tools.py) and the request fields for both (structured_requests.py), a router over replicas with
prefix affinity and a canary share (router.py), prefill/decode disaggregation: K/V shipped as bytes
from prefill engines into decode engines' prefix caches (kv_transfer.py) behind one replica
(disagg.py), Prometheus metrics (metrics.py), the load benchmark with SLO goodput (bench.py), the
vLLM Kubernetes manifests for cluster scale, with an autoscaler and SLO alerts (k8s.py), the lifecycle's
serve stage (stage.py) and what it deploys, the registry's champion (champion.py), a plain command
line (cli.py) and the tiny checkpoint tests and the benchmark build (testing.py)."""

import os
from pathlib import Path


def cache_root() -> Path:
    """Where what the engine builds once per machine is kept (llama.cpp, the slot kernel): `EIGHTFOLD_CACHE`,
    or ~/.cache/eightfold."""
    return Path(os.environ.get("EIGHTFOLD_CACHE", Path.home() / ".cache" / "eightfold"))
