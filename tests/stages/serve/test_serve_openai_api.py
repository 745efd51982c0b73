"""The server as a vLLM user drives it, with the openai client, on a chat model the export stage
wrote (stages/export/hf.py with the tokenizer stage's own tokenizer and chat template): chat that
ends its turn, all five roles and content parts rendered as transformers renders the exported
template, 400s naming what is wrong, vLLM's sampling fields against a reference greedy loop on
the same weights in transformers, n / best_of / seeds, streamed logprobs, prompt_logprobs, the
extra endpoints, unknown fields, and vLLM's metric names as the rendered alerts and HPA read them.
One server for the module; a random tiny model (its text is noise, its token ids are what count)."""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from stages.serve.server import ServerThread, build_app, build_router
from stages.serve.tools import parse_tool_calls, render_tool_call

CONTEXT = 512  # the model's max_position_embeddings: a chat without max_tokens runs to it
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ALL_ROLES = [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": [{"type": "text", "text": "Answer in English."},
                                      {"type": "text", "text": "Use tools when useful."}]},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Thanks."},
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A Hugging Face folder as the export stage writes it: a byte-level BPE from the tokenizer stage
    (its chat template, `<|end|>` closing each turn) and a random dense model of our trainer."""
    from infra.config.model import ModelConfig
    from stages.export.hf import write_hf
    from stages.serve.testing import _stdlib_text
    from stages.tokenizer import save_hf, train_bpe
    from trainer.model import Transformer

    tok_dir = tmp_path_factory.mktemp("chat_tokenizer")
    save_hf(train_bpe(_stdlib_text(300_000), 512, 2), tok_dir)
    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=CONTEXT)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("chat_export")
    write_hf(Transformer(cfg).state_dict(), cfg, out, dtype="float32", tokenizer_dir=tok_dir)
    return out


@pytest.fixture(scope="module", params=["thread", "process"])
def served(exported, request):
    """The server with the engine stepping on a thread of its own, and with the engine core in a process
    of its own (engine_core.py): every test here runs against both."""
    router = build_router(str(exported), num_kv_blocks=256, max_num_seqs=16,
                          engine_process=request.param == "process", threads=1).start()
    with ServerThread(build_app(router)) as srv:
        yield srv, router
    router.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(exported))


def _name(served) -> str:
    return served[1].primary.model_name


def _ids(hf, *tokens: str) -> list[int]:
    return [hf[1].convert_tokens_to_ids(t) for t in tokens]


def test_chat_ends_its_turn_at_the_end_of_turn_token(client, served, hf):
    end, eos = _ids(hf, "<|end|>", "<|eos|>")
    assert served[1].primary.engine.eos_token_ids == {end, eos}  # generation_config.json's list
    msgs = [{"role": "user", "content": "Hi"}]
    # the end of turn made likely (a random model never says it), held back for 3 tokens by min_tokens
    kw = dict(model=_name(served), messages=msgs, temperature=0, logit_bias={str(end): 100}, extra_body={"min_tokens": 3})
    chat = client.chat.completions.create(**kw)
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 4  # 3, then <|end|>
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    # the same request ignoring EOS runs to its max_tokens
    again = client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True}}, max_tokens=7)
    assert again.choices[0].finish_reason == "length" and again.usage.completion_tokens == 7


def test_chat_without_max_tokens_runs_to_the_context_end(client, served, hf):
    end, eos = _ids(hf, "<|end|>", "<|eos|>")
    chat = client.chat.completions.create(model=_name(served), messages=[{"role": "user", "content": "Go on"}],
                                          temperature=0, logit_bias={str(end): -100, str(eos): -100})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == CONTEXT


def test_template_renders_tool_calls_as_the_tool_parser_reads_them(hf):
    # the chat template (stages/tokenizer.py) and tools.py must agree on the Hermes format, so a model
    # post-trained on the template writes what the grammar forces and the parser reads back
    calls = [("get_weather", {"city": "Paris", "note": "é \"q\""}), ("noop", {})]
    msg = {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]}
    text = hf[1].apply_chat_template([msg], tokenize=False, add_generation_prompt=False)
    turn = text.split("<|assistant|>\n", 1)[1].rsplit("<|end|>", 1)[0]
    assert turn == "Checking." + "\n".join(render_tool_call(n, a) for n, a in calls)
    content, parsed = parse_tool_calls(turn)
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in parsed] == calls


def test_every_role_content_parts_and_tools_render_as_transformers_renders_them(client, served, hf):
    tok = hf[1]
    # transformers' convention for the reference: tool-call arguments as an object (the server parses the string)
    as_hf = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                  for c in m["tool_calls"]]} if "tool_calls" in m else m for m in ALL_ROLES]
    want = tok.apply_chat_template(as_hf, tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False)
    got = httpx.post(served[0].url + "/tokenize", json={"messages": ALL_ROLES, "tools": TOOLS}).json()
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == CONTEXT
    text = tok.decode(want)
    for piece in ("<|system|>\nAnswer in English.\nUse tools when useful.<|end|>", '"name": "get_weather"',
                  render_tool_call("get_weather", {"city": "Paris"}) + "<|end|>",
                  "<|user|>\n<tool_response>sunny, 21 C</tool_response><|end|>"):
        assert piece in text, piece
    chat = client.chat.completions.create(model=_name(served), messages=ALL_ROLES, tools=TOOLS, max_tokens=3, temperature=0)
    assert chat.usage.prompt_tokens == len(want) and chat.choices[0].message.role == "assistant"
    for role_msgs in ([m] for m in ALL_ROLES if m["role"] != "tool"):  # each role alone is a 200 too
        assert client.chat.completions.create(model=_name(served), messages=role_msgs, max_tokens=1).choices


@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "text parts only"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "needs content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{not json"}}]}]},
     "arguments are not JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 5}}, "chat template cannot render"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"100000": 5}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"the": 5}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "context length"),
])
def test_bad_chat_requests_get_400_naming_the_problem(served, body, needle):
    r = httpx.post(served[0].url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "streamed"),
    ({"prompt": "x", "n": 0}, "n"),
])
def test_bad_completion_requests_get_400(served, body, needle):
    r = httpx.post(served[0].url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def _reference_greedy(hf, prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0,
                      bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding in transformers with vLLM's processors written out token by token, as
    vLLM's docs define them: bias added; a token seen in the prompt or output has a positive logit
    divided (a negative one multiplied) by the repetition penalty; frequency x its output count
    and presence once if it is in the output are subtracted."""
    model, _ = hf
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].double().tolist()
            for t, b in (bias or {}).items():
                logits[t] += b
            for t in set(ids):
                if repetition != 1.0:
                    logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
            nxt = max(range(len(logits)), key=logits.__getitem__)
            ids.append(nxt)
            out.append(nxt)
    return out


def test_penalties_and_bias_are_applied_per_request_inside_a_batch(served, hf):
    tok = hf[1]
    url = served[0].url + "/v1/completions"
    prompt = tok.encode("def f(x):\n    return x + x + x", add_special_tokens=False)
    # a random model's greedy text never repeats a token, so the penalties would have nothing to act
    # on: a bias makes token 65 repeat, and the penalties then have to fight it
    cases = [
        {},
        {"logit_bias": {"65": 4.0}},
        {"logit_bias": {"65": 4.0}, "presence_penalty": 1.5, "frequency_penalty": 0.7, "repetition_penalty": 1.8},
        {"repetition_penalty": 0.5, "logit_bias": {"65": 4.0, "300": -50.0}, "min_tokens": 2},
    ]
    n = 12

    def one(extra):
        body = {"model": _name(served), "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True, **extra}
        return httpx.post(url, json=body, timeout=60).json()

    with ThreadPoolExecutor(len(cases) * 2) as pool:  # concurrent: the engine batches them in one step
        outs = list(pool.map(one, cases * 2))
    got_ids = [[int(t.removeprefix("token_id:")) for t in o["choices"][0]["logprobs"]["tokens"]] for o in outs]
    for extra, got in zip(cases * 2, got_ids):
        bias = {int(k): v for k, v in extra.get("logit_bias", {}).items()}
        want = _reference_greedy(hf, prompt, n, extra.get("presence_penalty", 0.0), extra.get("frequency_penalty", 0.0),
                                 extra.get("repetition_penalty", 1.0), bias)
        assert got == want, extra
    # each processor changed the greedy path, so the equalities above test them
    assert got_ids[1] == [65] * n and got_ids[0] != got_ids[1] != got_ids[2]


def test_n_seeds_best_of_and_streamed_choices(client, served):
    name, prompt = _name(served), "import os\n"
    kw = dict(model=name, prompt=prompt, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    three = client.completions.create(**kw, n=3, seed=11, logprobs=0)
    assert [c.index for c in three.choices] == [0, 1, 2] and three.usage.completion_tokens == 24
    # sample i of a seeded request is the single request seeded seed + i (vLLM's rule)
    for i, c in enumerate(three.choices):
        assert client.completions.create(**kw, seed=11 + i).choices[0].text == c.text
    # best_of: the likeliest of the same three samples
    best = client.completions.create(**kw, n=1, seed=11, best_of=3)
    totals = [sum(c.logprobs.token_logprobs) for c in three.choices]
    assert best.choices[0].text == three.choices[totals.index(max(totals))].text
    # streamed: each choice's chunks carry its index and add up to the same text
    texts = {0: "", 1: ""}
    for ch in client.completions.create(**kw, n=2, seed=11, stream=True):
        texts[ch.choices[0].index] += ch.choices[0].text
    assert texts == {0: three.choices[0].text, 1: three.choices[1].text}


def test_stop_strings_with_and_without_the_stop_string(client, served):
    kw = dict(model=_name(served), prompt="class A:\n", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    # a two-character ASCII stop string from the second half (random text may hold partial UTF-8)
    stop = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].isascii()
                and full[i:i + 2].strip())
    at = full.find(stop)
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    kept = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                     stop=[stop]).choices[0]
    assert cut.text == full[:at] and kept.text == full[:at + len(stop)]
    assert cut.finish_reason == kept.finish_reason == "stop"


def test_logprobs_streamed_and_prompt_logprobs_match_transformers(client, served, hf):
    model, tok = hf
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    kw = dict(model=_name(served), messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [x for ch in client.chat.completions.create(**kw, stream=True) if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    # the same tokens and logprobs up to float32 rounding: the second request reuses the first's prompt
    # K/V (prefix cache), so its last prompt position is computed by a decode step, not the prefill
    assert [x.token for x in streamed] == [x.token for x in whole]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in whole], rel=1e-5, abs=1e-6)
    assert all(len(x.top_logprobs) == 2 for x in streamed)
    # prompt_logprobs (a vLLM field): every prompt token's logprob under the model, as transformers computes it
    raw = httpx.post(served[0].url + "/v1/chat/completions",
                     json={"model": _name(served), "messages": msgs, "max_tokens": 1, "prompt_logprobs": 1}).json()
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    plp = raw["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for pos in range(1, len(ids)):
        entry = plp[pos][str(ids[pos])]
        assert entry["logprob"] == pytest.approx(float(lp[pos - 1, ids[pos]]), abs=1e-4)
        x = lp[pos - 1, ids[pos]]  # rank within what float error (1e-4 here) may reorder
        assert int((lp[pos - 1] > x + 1e-4).sum()) + 1 <= entry["rank"] <= int((lp[pos - 1] > x - 1e-4).sum()) + 1


def test_tokenize_detokenize_models_version_and_unknown_fields(served, caplog, hf):
    url, name = served[0].url, _name(served)
    ids = httpx.post(url + "/tokenize", json={"prompt": "def main():", "return_token_strs": True}).json()
    assert ids["tokens"] == hf[1].encode("def main():", add_special_tokens=False)
    assert httpx.post(url + "/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "def main():"}
    assert httpx.post(url + "/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert httpx.post(url + "/tokenize", json={"prompt": "x", "messages": []}).status_code == 400
    card = httpx.get(url + f"/v1/models/{name}").json()
    assert card["id"] == name and card["max_model_len"] == CONTEXT
    assert httpx.get(url + "/v1/models/nope").status_code == 404
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", httpx.get(url + "/version").json()["version"])
    with caplog.at_level(logging.WARNING, logger="stages.serve.protocol"):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": 3})
    assert r.status_code == 200
    assert any("frobnicate" in rec.getMessage() and "ignored" in rec.getMessage() for rec in caplog.records)


def test_metric_names_are_vllms_and_the_rendered_alerts_and_hpa_find_them(client, served):
    import yaml

    from stages.serve.k8s import Autoscaling, VLLMDeployment, render_adapter_rules, render_yaml

    client.chat.completions.create(model=_name(served), messages=[{"role": "user", "content": "x"}], max_tokens=3)
    text = httpx.get(served[0].url + "/metrics").text
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_sum",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:num_preemptions_total"):
        assert name in samples, name
    success = [line for line in text.splitlines() if line.startswith("vllm:request_success_total{")]
    assert all(f'model_name="{_name(served)}"' in x and 'engine="0"' in x and "finished_reason=" in x for x in success)
    # every vLLM series the serve stage's manifests query (alerts, HPA through prometheus-adapter) is here
    d = VLLMDeployment(name="m", model_uri="/m", autoscaling=Autoscaling(), slo_ttft_ms=500, slo_tpot_ms=50)
    rendered = render_yaml(d) + yaml.safe_dump(render_adapter_rules(d))
    used = {m.replace("vllm_", "vllm:", 1) for m in re.findall(r"\bvllm[:_][a-z_]+", rendered)}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
            "vllm:request_time_per_output_token_seconds"} <= {re.sub(r"_bucket$", "", m) for m in used}
    for m in used:
        assert m in samples or m + "_total" in samples or m.removesuffix("_bucket") + "_bucket" in samples, m
