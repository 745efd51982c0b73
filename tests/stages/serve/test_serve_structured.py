"""Structured outputs and tool calls, as a vLLM user sends them with the openai client to the
server `eightfold serve` runs, on the tiny random checkpoint: every constrained output parses and
validates (JSON schema, json_object, choice, regex, EBNF), tool calls come back as `tool_calls`
whose arguments validate against the tool's schema, streamed and not, invalid constraints get a
400 naming the problem; and, on the engine, the mask touches only constrained rows and speculative
decoding keeps both the grammar and greedy equality.

A random model is the grammar's worst case (it picks whatever the mask allows); the schemas bound
every string, number and array, so each output is finite and max_tokens never cuts one."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams
from stages.serve.server import ServerThread, build_app, build_router
from stages.serve.structured_output import StructuredOutput
from stages.serve.tools import ToolCallParser, parse_tool_calls, render_tool_call

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                               "maxItems": 3}},
     "required": ["colour", "tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"]}, "label": {"type": ["string", "null"], "maxLength": 8}},
     "required": ["point", "label"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                                 "done": {"type": "boolean"}},
                                "required": ["id", "done"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"kind": {"const": "event"}, "level": {"enum": [1, 2, 3]},
                                      "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]}},
     "required": ["kind", "level", "note"]},
]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}}}


def _strict_json(text: str):
    return json.loads(text)  # strict: a raw control character inside a string fails too


@pytest.fixture(scope="module")
def served(tiny_hf_model_dir):
    router = build_router(str(tiny_hf_model_dir), num_kv_blocks=512, max_num_seqs=64).start()
    with ServerThread(build_app(router)) as srv:
        yield srv, router
    router.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _user(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe item {i} as JSON."}]


def test_fifty_json_schema_requests_all_parse_and_validate(client):
    """50 concurrent chat requests, 5 schemas, greedy and seeded sampling: every output is
    complete (finish_reason stop), strict JSON and valid under its schema."""

    def one(i: int):
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = client.chat.completions.create(
            model="", messages=_user(i), max_tokens=400, temperature=0 if i % 2 else 1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i % 5}", "schema": schema, "strict": True}})
        return schema, r.choices[0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(50)))
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(_strict_json(choice.message.content), schema)


def test_json_object_parses(client):
    """json_object is any object: strings are unbounded, so a random model may run into max_tokens
    inside one; every output that ended on its own is a JSON object (and some did)."""
    finished = 0
    for i in range(8):
        r = client.chat.completions.create(model="", messages=_user(i), max_tokens=120, temperature=0,
                                           response_format={"type": "json_object"})
        c = r.choices[0]
        assert c.message.content.lstrip().startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(_strict_json(c.message.content), dict)
            finished += 1
    assert finished >= 1


def test_choice_regex_and_grammar_outputs_match(client, served):
    import re

    choices = ["yes", "no", 'a "quoted"\nanswer']
    for i in range(6):
        # vLLM's fields as extra_body: structured_outputs, and the older guided_* fields
        r = client.chat.completions.create(model="", messages=_user(i), max_tokens=20, temperature=1.0, seed=i,
                                           extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
        r = client.chat.completions.create(model="", messages=_user(i), max_tokens=20, temperature=1.0, seed=i,
                                           extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices
        pattern = r"[a-z]{2,5}-\d{3}(\.[A-Z])?"
        r = client.completions.create(model="", prompt=f"code {i}:", max_tokens=30, temperature=1.0, seed=i,
                                      extra_body={"guided_regex": pattern})
        assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop"
        grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
        r = client.completions.create(model="", prompt=f"list {i}:", max_tokens=60, temperature=1.0, seed=i,
                                      extra_body={"structured_outputs": {"grammar": grammar}})
        text = r.choices[0].text
        if r.choices[0].finish_reason == "stop":
            assert re.fullmatch(r"\((?:[0-9]|x)(?:,(?:[0-9]|x))*\)", text), text
        else:  # cut by max_tokens: a prefix of the language
            assert re.fullmatch(r"\((?:[0-9]|x)?(?:,(?:[0-9]|x)?)*", text), text
    # a constrained request ends at the grammar's end even with ignore_eos (the benchmark's setting)
    r = httpx.post(served[0].url + "/v1/completions", json={
        "prompt": "answer:", "max_tokens": 50, "ignore_eos": True, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["on", "off"]}}}})
    body = r.json()["choices"][0]
    assert json.loads(body["text"]) in ("on", "off") and body["finish_reason"] == "stop"


def _accumulate(stream) -> tuple[str, dict[int, dict], str | None]:
    content, calls, finish = "", {}, None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert c["id"] is None, "the id comes once, with the call's first piece"
                c["id"], c["name"] = tc.id, tc.function.name
            c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_tool_call_returns_parseable_arguments_streamed_and_not(client, temperature):
    tools = [WEATHER, CLOCK]
    params = WEATHER["function"]["parameters"]
    for i in range(3):
        kw = dict(model="", messages=[{"role": "user", "content": f"Weather in city {i}?"}], tools=tools,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=300,
                  temperature=temperature, seed=i)
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and not c.message.content
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        args = _strict_json(call.function.arguments)
        jsonschema.validate(args, params)
        content, calls, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls" and not content and list(calls) == [0]
        assert calls[0]["name"] == "get_weather" and calls[0]["id"]
        # the same request (greedy, or the same seed) gives the same arguments, piece by piece
        assert calls[0]["arguments"] == call.function.arguments


def test_required_tool_choice_calls_tools_that_validate(client):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    seen = set()
    for i in range(6):
        kw = dict(model="", messages=[{"role": "user", "content": f"Help {i}"}], tools=[WEATHER, CLOCK],
                  tool_choice="required", max_tokens=400, temperature=1.0, seed=i, parallel_tool_calls=i % 2 == 0)
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        if i % 2:
            assert len(c.message.tool_calls) == 1  # parallel_tool_calls=False: one call
        for call in c.message.tool_calls:
            jsonschema.validate(_strict_json(call.function.arguments), by_name[call.function.name])
            seen.add(call.function.name)
        content, calls, finish = _accumulate(client.chat.completions.create(**kw, stream=True))
        assert finish == "tool_calls"
        assert [(x["name"], x["arguments"]) for x in calls.values()] == \
            [(x.function.name, x.function.arguments) for x in c.message.tool_calls]
    assert seen == set(by_name)  # sampling reached both tools


def test_auto_and_none_tool_choice(client):
    """auto: free text, parsed for calls (a random model writes none); none: no parsing at all."""
    for choice in ("auto", "none"):
        c = client.chat.completions.create(model="", messages=_user(1), tools=[WEATHER], tool_choice=choice,
                                           max_tokens=12, temperature=0).choices[0]
        assert c.finish_reason == "length" and c.message.content and not c.message.tool_calls


@pytest.mark.parametrize("extra, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "properties/a/type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(ab"}, "guided_regex: invalid regex"),
    ({"guided_json": "{not json"}, "guided_json: not valid JSON"),
    ({"structured_outputs": {"grammar": 'root ::= "a" rest'}}, "structured_outputs.grammar: invalid grammar"),
    ({"structured_outputs": {"choice": []}}, "choice"),
    ({"structured_outputs": {"jsn": {}}}, "jsn"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "give one output constraint"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": []}, "tools must not be an empty array"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]}, "tools[f].parameters"),
])
def test_invalid_constraints_get_400_naming_the_problem(served, extra, needle):
    r = httpx.post(served[0].url + "/v1/chat/completions",
                   json={"messages": _user(0), "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_tool_call_parser_streams_what_it_parses_whole():
    texts = [
        "Sure.\n" + render_tool_call("get_weather", {"city": "Paris", "n": [1, {"a": "}"}]}) + "\n"
        + render_tool_call("noop", {}),
        render_tool_call("f", '{"x": "a\\"b</tool_call>"}'),
        "no call here <tool_ca but text",
        '<tool_call>\n{"arguments": {"a": 1}, "name": "g"}\n</tool_call>',  # another key order: parsed whole
        "<tool_call>not json</tool_call> tail",
        render_tool_call("cut", {"a": 1})[:-15],  # cut by max_tokens mid-arguments
    ]
    want = [("Sure.\n", [("get_weather", '{"city": "Paris", "n": [1, {"a": "}"}]}'), ("noop", "{}")]),
            ("", [("f", '{"x": "a\\"b</tool_call>"}')]),
            ("no call here <tool_ca but text", []),
            ("", [("g", '{"a": 1}')]),
            ("<tool_call>not json</tool_call> tail", []),
            ("", [("cut", '{"a": 1')])]
    for text, (content, calls) in zip(texts, want):
        got = parse_tool_calls(text)
        assert (got[0], [(c.name, c.arguments) for c in got[1]]) == (content, calls)
        for seed in range(50):  # any split into pieces streams the same content and calls
            rng, p, i = random.Random(seed), ToolCallParser(), 0
            streamed, names, args = "", {}, {}
            pieces = []
            while i < len(text):
                n = rng.randint(1, 7)
                pieces.append(p.feed(text[i:i + n]))
                i += n
            pieces.append(p.finish())
            for c, deltas in pieces:
                streamed += c
                for d in deltas:
                    if d.id is not None:
                        names[d.index] = d.name
                    args[d.index] = args.get(d.index, "") + d.arguments
            assert streamed == content
            assert [(names[k], args[k]) for k in sorted(names)] == calls


# -- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_engine(tiny_hf_model_dir):
    return LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=256))


def _grammar_params(n: int, temperature: float = 0.0) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=300, temperature=temperature, seed=i,
                           structured_output=StructuredOutput(json=SCHEMAS[i % len(SCHEMAS)])) for i in range(n)]


def test_only_constrained_rows_are_masked(plain_engine):
    """Plain requests batched beside constrained ones give exactly what they give alone."""
    prompts = [f"def f{i}(x):" for i in range(6)]
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in plain_engine.generate(prompts[:3], [plain] * 3)]
    outs = plain_engine.generate(prompts, [plain] * 3 + _grammar_params(3))
    assert [o.token_ids for o in outs[:3]] == alone
    for o, schema in zip(outs[3:], SCHEMAS):
        jsonschema.validate(_strict_json(o.text), schema)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_grammar_and_greedy_output(kind, plain_engine, tiny_hf_model_dir,
                                                                 tiny_hf_draft_dir):
    """Draft tokens are checked against each request's grammar and the matcher rolled back: greedy
    outputs equal plain decoding's, sampled ones validate, and drafts were proposed and accepted
    (the n-gram drafts copy the JSON's repeated whitespace and keys; the draft model's often break
    the grammar and are rejected)."""
    spec = LLMEngine(tiny_hf_model_dir, EngineConfig(num_kv_blocks=256, speculative=kind, num_speculative_tokens=4,
                                                     draft_model_dir=str(tiny_hf_draft_dir)))
    prompts = [f"Item {i} as JSON:" for i in range(5)]
    want = plain_engine.generate(prompts, _grammar_params(5))
    got = spec.generate(prompts, _grammar_params(5))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o, schema in zip(spec.generate(prompts, _grammar_params(5, temperature=1.0)), SCHEMAS):
        assert o.finish_reason == "stop"
        jsonschema.validate(_strict_json(o.text), schema)
    m = spec.metrics
    assert m.spec_proposed.value(model_name=spec.model_name) > 0 and m.spec_accepted.value(model_name=spec.model_name) > 0


def test_bitmask_rows_for_drafts_follow_the_grammar(plain_engine):
    """Row j of a request verifying drafts is masked by the grammar's state after drafts 0..j-1; rows
    past the first draft the grammar refuses are left alone; the matcher ends where it began."""
    from stages.serve.structured_output import GrammarBitmask

    eng = plain_engine
    spec = StructuredOutput(regex=r"ab[0-9]+c")
    tok = eng.tokenizer
    ids = {ch: tok.convert_tokens_to_ids(ch) for ch in "ab7xc"}

    class Req:
        grammar = eng.grammar_backend().matcher(spec, [eng.eos_token_id])

    vocab = eng.model.shape.vocab_size
    logits = torch.zeros(5, vocab)
    GrammarBitmask(vocab).apply(logits, [(0, Req, [ids["a"], ids["b"], ids["x"], ids["7"]])])
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]
    assert allowed[0] and ids["a"] in allowed[0] and ids["b"] not in allowed[0]  # before "a"
    assert ids["b"] in allowed[1] and ids["a"] not in allowed[1]  # after "a"
    assert ids["7"] in allowed[2] and ids["x"] not in allowed[2] and ids["c"] not in allowed[2]  # after "ab"
    assert allowed[3] == allowed[4] == set(range(vocab))  # past the refused "x": untouched
    again = torch.zeros(1, vocab)
    GrammarBitmask(vocab).apply(again, [(0, Req, [])])  # rolled back: the first row's mask again
    assert set(torch.nonzero(again[0] > float("-inf")).flatten().tolist()) == allowed[0]



def test_a_repeated_schema_is_checked_and_compiled_once(plain_engine, monkeypatch):
    """Requests repeating one schema reuse its checked, compiled grammar; a different schema, or
    the same one without free whitespace, is its own; an invalid one is refused every time."""
    import stages.serve.structured_output as so

    backend = plain_engine.grammar_backend()
    checks = []
    check = so.check_json_schema
    monkeypatch.setattr(so, "check_json_schema", lambda s, o: (checks.append(o), check(s, o))[1])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": len(backend._recent)}}}
    first = backend.compile(StructuredOutput(json=schema))
    assert backend.compile(StructuredOutput(json=json.loads(json.dumps(schema)))) is first and len(checks) == 1
    assert backend.compile(StructuredOutput(json=schema, any_whitespace=False)) is not first
    assert backend.compile(StructuredOutput(json={**schema, "required": ["n"]})) is not first and len(checks) == 3
    for _ in range(2):
        with pytest.raises(ValueError, match="invalid JSON schema"):
            backend.compile(StructuredOutput(json={"type": "objekt"}))
