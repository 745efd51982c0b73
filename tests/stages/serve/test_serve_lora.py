"""Multi-LoRA serving (stages/serve/lora.py) against transformers + PEFT on the same weights.

Two adapters on a model the export stage wrote: `sql`, the post-train job's own adapter as the export
stage ships it (trainer/lora.py, stages/export/peft_adapter.py; q, v and down projections), and `chat`,
built by PEFT itself (every projection, a larger rank, rsLoRA scaling). Both have random non-zero B, so
they change what the model says. Each adapter's greedy output, through the engine and through the
server with the openai client, equals PeftModel.from_pretrained(base, adapter).generate token for
token while base-model requests run in the same steps and still equal plain transformers; the
per-row update itself equals a merged-weight reference row by row; the prefix cache keeps adapters
apart; the load/unload endpoints and the 404s behave as vLLM's."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.lora import LoRAError, LoRAStep, load_lora_adapter
from stages.serve.sampling import SamplingParams
from stages.serve.server import ServerThread, build_app, build_router, parse_lora_modules

CONTEXT = 512
PROMPTS = ["def parse(self, text):\n    return", "import os\nimport sys\n\nclass Config:\n    def __init__(self):",
           "SELECT name FROM users WHERE", "for i in range(10):\n    print(i"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An export (HF folder with the tokenizer stage's tokenizer) and two PEFT adapters for it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from infra.config.model import ModelConfig
    from stages.export.hf import write_hf
    from stages.export.peft_adapter import write_peft_adapter
    from stages.serve.testing import _stdlib_text
    from stages.tokenizer import save_hf, train_bpe
    from trainer.lora import apply_lora, save_peft
    from trainer.model import Transformer

    root = tmp_path_factory.mktemp("lora_export")
    save_hf(train_bpe(_stdlib_text(300_000), 512, 2), root / "tok")
    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=CONTEXT)
    torch.manual_seed(0)
    model = Transformer(cfg)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    write_hf(base, cfg, root / "base", dtype="float32", tokenizer_dir=root / "tok")

    # the post-train job's adapter, through the export stage's writer (which checks it)
    apply_lora(model, r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    save_peft(model, root / "post" / "adapter")
    write_peft_adapter(root / "post" / "adapter", root / "sql", cfg, base_model="../base")

    # an adapter made by PEFT itself on the exported base
    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_pretrained(str(root / "base"), dtype=torch.float32)
    conf = LoraConfig(r=8, lora_alpha=16, use_rslora=True, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    get_peft_model(hf, conf).save_pretrained(str(root / "chat"))
    return root


@pytest.fixture(scope="module")
def reference(exported):
    """Greedy continuations by transformers: the base model and each adapter through PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(exported / "base"))
    models = {None: AutoModelForCausalLM.from_pretrained(str(exported / "base"), dtype=torch.float32).eval()}
    for name in ("sql", "chat"):
        base = AutoModelForCausalLM.from_pretrained(str(exported / "base"), dtype=torch.float32)
        models[name] = PeftModel.from_pretrained(base, str(exported / name)).eval()
    cache: dict = {}

    def greedy(adapter: str | None, ids: list[int], n: int) -> list[int]:
        key = (adapter, tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                out = models[adapter].generate(input_ids=torch.tensor([ids]),
                                               attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                               max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                               pad_token_id=0)
            cache[key] = out[0, len(ids):].tolist()
        return cache[key]

    greedy.encode = lambda text: tok.encode(text, add_special_tokens=False)  # as LLMEngine.encode
    return greedy


class ForwardSpy:
    """Records, per forward of the engine's model, its rows and how many of them each adapter had."""

    def __init__(self, model):
        self.model, self.calls, self.inner = model, [], model.forward
        self.joined = []  # per forward: adapter rows in a step where whole prompts join the decodes

        def forward(input_ids, meta, cache, logits_index, lora=None):
            T = int(input_ids.shape[0])
            groups = {}
            for adapter, rows in (lora.groups if lora is not None else []):
                n = T if rows is None else (rows.stop - rows.start) if isinstance(rows, slice) else int(rows.numel())
                groups[adapter.name] = n
            self.calls.append((T, groups))
            self.joined.append(bool(groups) and meta.prompts_join)
            return self.inner(input_ids, meta, cache, logits_index, lora)

        model.forward = forward

    def mixed_steps(self, adapters: set[str]) -> int:
        """Forwards with rows of every one of `adapters` and base-model rows too."""
        return sum(1 for T, g in self.calls if adapters <= set(g) and sum(g.values()) < T)


# -- the per-row update against merged weights ---------------------------------------------------------


def test_rows_grouped_by_adapter_get_their_own_update(exported):
    """Each row of a mixed batch gets W x + its adapter's s B A x: compared with F.linear on that
    adapter's merged weight, row by row (float64, so the bound is rounding only: 1e-10)."""
    from stages.serve.model import LlamaShape

    shape = LlamaShape.from_hf_config(json.loads((exported / "base" / "config.json").read_text()))
    dev = torch.device("cpu")
    sql = load_lora_adapter("sql", exported / "sql", shape, torch.float64, dev)
    chat = load_lora_adapter("chat", exported / "chat", shape, torch.float64, dev)
    # the model's fused q/k/v of layer 0, from the same file
    from safetensors.torch import load_file
    sd = load_file(str(next((exported / "base").glob("*.safetensors"))))
    w = torch.cat([sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]).double()
    runs = [(None, 3), (sql, 2), (chat, 4), (sql, 1), (None, 2), (chat, 1)]  # interleaved, as a flat batch
    step = LoRAStep.from_runs(runs, dev)
    assert {a.name: (type(r).__name__) for a, r in step.groups} == {"sql": "Tensor", "chat": "Tensor"}
    x = torch.randn(sum(n for _, n in runs), w.shape[1], dtype=torch.float64)
    got = torch.nn.functional.linear(x, step.wrap(0, "qkv", w))

    def merged(adapter_dir, conf_scale):
        from safetensors.torch import load_file as lf
        t = lf(str(adapter_dir / "adapter_model.safetensors"))
        delta = []
        for p in "qkv":
            key = f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_"
            if key + "A.weight" in t:
                delta.append(t[key + "B.weight"].double() @ t[key + "A.weight"].double() * conf_scale)
            else:
                delta.append(torch.zeros_like(sd[f"model.layers.0.self_attn.{p}_proj.weight"]).double())
        return w + torch.cat(delta)

    weights = {None: w, "sql": merged(exported / "sql", 8.0 / 4), "chat": merged(exported / "chat", 16 / 8 ** 0.5)}
    row = 0
    for adapter, n in runs:
        want = torch.nn.functional.linear(x[row:row + n], weights[None if adapter is None else adapter.name])
        assert (got[row:row + n] - want).abs().max() < 1e-10, (adapter and adapter.name, row)
        row += n
    assert (weights["sql"] - w).abs().max() > 1e-2 and (weights["chat"] - w).abs().max() > 1e-2
    # one contiguous run: a slice; every row: no index at all; no adapter rows: no step
    assert isinstance(LoRAStep.from_runs([(None, 2), (sql, 3), (sql, 1)], dev).groups[0][1], slice)
    assert LoRAStep.from_runs([(sql, 3), (sql, 1)], dev).groups[0][1] is None
    assert LoRAStep.from_runs([(None, 3)], dev) is None


# -- the engine: adapters and the base model in one step -------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"decode_slots": False},
                                     {"speculative": "ngram", "num_speculative_tokens": 3}],
                         ids=["decode-slots", "paged", "ngram"])
def test_engine_adapter_and_base_requests_share_steps_and_equal_transformers(exported, reference, options):
    eng = LLMEngine(exported / "base", EngineConfig(num_kv_blocks=256, max_num_seqs=16, **options))
    eng.load_lora("sql", exported / "sql")
    eng.load_lora("chat", exported / "chat")
    spy = ForwardSpy(eng.model)
    n = 24
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    jobs = {}
    for text in PROMPTS:
        ids = reference.encode(text)
        for adapter in (None, "sql", "chat"):
            jobs[eng.add_request(ids, sp, lora_name=adapter)] = (adapter, ids)
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.token_ids
    for rid, (adapter, ids) in jobs.items():
        assert got[rid] == reference(adapter, ids, n), (adapter, ids)
    # the first forward prefilled all twelve prompts together, and decodes kept mixing them
    assert spy.calls[0][1].keys() == {"sql", "chat"} and spy.mixed_steps({"sql", "chat"}) >= 2
    # each adapter really answers otherwise than the base model
    outs = {(a, tuple(ids)): got[r] for r, (a, ids) in jobs.items()}
    assert all(outs[("sql", k[1])] != outs[(None, k[1])] and outs[("chat", k[1])] != outs[(None, k[1])]
               for k in outs if k[0] is None)


def test_prefix_cache_keeps_adapters_apart(exported, reference):
    """The same prompt under the base model, an adapter, another adapter and the same adapter
    reloaded: only the same (name, load) hits the blocks, and every output stays the reference's."""
    eng = LLMEngine(exported / "base", EngineConfig(num_kv_blocks=256, max_num_seqs=8, block_size=8))
    eng.load_lora("sql", exported / "sql")
    eng.load_lora("chat", exported / "chat")
    ids = reference.encode(PROMPTS[1])
    assert len(ids) > 2 * 8  # two full blocks at least
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(adapter, weights=None):
        rid = eng.add_request(ids, sp, lora_name=adapter)
        while eng.has_unfinished():
            for o in eng.step():
                if o.request_id == rid and o.finished:
                    out = o
        assert out.token_ids == reference(weights or adapter, ids, 8)
        return out.num_cached_tokens

    full = (len(ids) - 1) // 8 * 8
    assert run(None) == 0 and run("sql") == 0 and run("chat") == 0  # the base model's blocks are not theirs
    assert run("sql") == full and run(None) == full and run("chat") == full
    eng.load_lora("sql", exported / "chat", replace=True)  # the name, other weights: a cold cache
    assert run("sql", "chat") == 0
    assert run("sql", "chat") == full


@pytest.mark.slow
def test_compiled_engine_runs_adapter_steps_eagerly_and_exactly(exported, reference):
    """enforce_eager=False: all-decode steps of base requests stay compiled; steps with adapter rows
    (decodes and prompts joining the batch alike) run the eager pieces through the adapted weights."""
    eng = LLMEngine(exported / "base", EngineConfig(num_kv_blocks=256, max_num_seqs=16, enforce_eager=False))
    if not eng.model.pieces.compiled:
        pytest.skip("torch.compile is unavailable here: the compiled path cannot be exercised")
    eng.load_lora("chat", exported / "chat")
    n = 16
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids = [reference.encode(t) for t in PROMPTS]
    calls_before = eng.model.pieces.num_calls
    first = [eng.add_request(ids[0], sp), eng.add_request(ids[1], sp)]
    eng.step()
    eng.step()  # two base requests decoding: a compiled step
    assert eng.model.pieces.num_calls > calls_before
    spy = ForwardSpy(eng.model)
    later = [eng.add_request(ids[2], sp, lora_name="chat"), eng.add_request(ids[3], sp)]  # prompts joining decodes
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.token_ids
    assert got[first[0]] == reference(None, ids[0], n) and got[first[1]] == reference(None, ids[1], n)
    assert got[later[0]] == reference("chat", ids[2], n) and got[later[1]] == reference(None, ids[3], n)
    assert spy.joined[0], "the adapter's prompt did not join the decode step"


def test_adapters_that_do_not_fit_are_refused_naming_why(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    from stages.serve.model import LlamaShape

    shape = LlamaShape.from_hf_config(json.loads((exported / "base" / "config.json").read_text()))
    conf = json.loads((exported / "chat" / "adapter_config.json").read_text())
    tensors = load_file(str(exported / "chat" / "adapter_model.safetensors"))

    def adapter(name, conf_update=None, tensors_update=None, drop=None):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({**conf, **(conf_update or {})}))
        t = {k: v for k, v in {**tensors, **(tensors_update or {})}.items() if k != drop}
        save_file(t, str(d / "adapter_model.safetensors"))
        return d

    def load(path):
        return load_lora_adapter("x", path, shape, torch.float32, torch.device("cpu"))

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(LoRAError, match=r"q_proj.lora_A.weight' has shape \(8, 32\), expected \(8, 64\)"):
        load(adapter("narrow", tensors_update={key: tensors[key][:, :32].contiguous()}))
    with pytest.raises(LoRAError, match="adapts layers.5.self_attn.q_proj, which this model does not have"):
        load(adapter("deep", tensors_update={key.replace("layers.0", "layers.5"): tensors[key].clone()}))
    with pytest.raises(LoRAError, match=r"missing \['layers.0.q_proj.lora_A'\]"):
        load(adapter("half", drop=key))
    with pytest.raises(LoRAError, match=r"options \['use_dora'\] are not supported"):
        load(adapter("dora", {"use_dora": True}))
    with pytest.raises(LoRAError, match="only LORA"):
        load(adapter("ia3", {"peft_type": "IA3"}))
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter folder"):
        load(tmp_path / "nothing")


def test_serve_command_takes_lora_modules(monkeypatch, exported, capsys):
    import stages.serve.server as server
    from stages.serve.cli import main

    seen = []
    monkeypatch.setattr(server, "serve_command", lambda model_dir, *a, **options: seen.append(options) or 0)
    assert main(["serve", "m", "--lora-modules", "sql=/a/sql", "chat=/a/chat"]) == 0
    assert seen[-1]["lora_modules"] == ["sql=/a/sql", "chat=/a/chat"]
    monkeypatch.undo()
    # bad values stop the server before it starts, naming the value: one line, exit code 2
    assert server.serve_command(str(exported / "base"), lora_modules=["sql"]) == 2
    said = lambda: " ".join(capsys.readouterr().out.split())  # noqa: E731 - rich wraps long lines
    assert "--lora-modules 'sql': expected NAME=PATH" in said()
    assert server.serve_command(str(exported / "base"), lora_modules=[f"x={exported / 'nothing'}"]) == 2
    assert "not a PEFT adapter folder" in said()


def test_lora_modules_option_parses_as_vllm_writes_it():
    assert parse_lora_modules(["a=/x/a", '{"name": "b", "path": "/x/b", "base_model_name": "m"}']) == \
        {"a": "/x/a", "b": "/x/b"}
    for bad in (["a"], ["=/x"], ['{"name": "b"}'], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)


# -- the server, as a vLLM client uses it --------------------------------------------------------------


@pytest.fixture(scope="module")
def served(exported):
    router = build_router(str(exported / "base"), num_kv_blocks=512, max_num_seqs=32,
                          lora_modules={"sql": str(exported / "sql"), "chat": str(exported / "chat")}).start()
    with ServerThread(build_app(router, runtime_lora_updating=True)) as srv:
        yield srv, router
    router.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module", params=["thread", "process"])
def lora_served(request, served, exported):
    """`served`, and the same server with its engine core in a process of its own (engine_core.py), where
    the adapters live in the core and the API process keeps their names."""
    if request.param == "thread":
        yield served[0], served[1], openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)
        return
    router = build_router(str(exported / "base"), num_kv_blocks=512, max_num_seqs=32, engine_process=True,
                          threads=1, lora_modules={"sql": str(exported / "sql"), "chat": str(exported / "chat")})
    with ServerThread(build_app(router.start(), runtime_lora_updating=True)) as srv:
        yield srv, router, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    router.shutdown()


def test_server_adapter_greedy_equals_peft_while_base_requests_share_the_batch(served, client, reference):
    srv, router = served
    engine = router.primary.engine
    spy = ForwardSpy(engine.model)
    base_name = router.primary.model_name
    n, long_n = 24, 320
    body = dict(temperature=0, extra_body={"ignore_eos": True})
    long_ids = reference.encode(PROMPTS[0])
    with ThreadPoolExecutor(16) as pool:
        # a long base-model generation runs throughout: every adapter request joins a running batch
        long = pool.submit(client.completions.create, model=base_name, prompt=PROMPTS[0], max_tokens=long_n, **body)
        deadline = time.monotonic() + 60
        while not engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.005)
        futures = {(m, t): pool.submit(client.completions.create, model=m, prompt=t, max_tokens=n, **body)
                   for t in PROMPTS for m in (base_name, "sql", "chat")}
        chat_future = pool.submit(client.chat.completions.create, model="sql", max_tokens=n,
                                  messages=[{"role": "user", "content": "Hi"}], **body)
        results = {k: f.result() for k, f in futures.items()}
        long_result = long.result()
        chat = chat_future.result()
    assert long_result.choices[0].text == engine.tokenizer.decode(reference(None, long_ids, long_n),
                                                                   skip_special_tokens=True)
    for (m, t), r in results.items():
        adapter = None if m == base_name else m
        assert r.model == m  # vLLM answers under the adapter's name
        want = reference(adapter, reference.encode(t), n)
        assert r.choices[0].text == engine.tokenizer.decode(want, skip_special_tokens=True), (m, t)
    assert chat.model == "sql" and chat.choices[0].finish_reason == "length"
    assert spy.mixed_steps({"sql", "chat"}) > 0  # both adapters and the base model in one forward


def test_models_list_adapters_with_their_parent(lora_served, exported):
    srv, router, client = lora_served
    base_name = router.primary.model_name
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {base_name, "sql", "chat"}
    assert cards["sql"].parent == base_name and cards["sql"].root == str(exported / "sql")
    assert cards[base_name].parent is None
    assert httpx.get(srv.url + "/v1/models/chat").json()["parent"] == base_name


def test_load_and_unload_endpoints_as_vllm(lora_served, exported, reference, tmp_path):
    srv, router, client = lora_served
    url = srv.url + "/v1/"
    ok = httpx.post(url + "load_lora_adapter", json={"lora_name": "extra", "lora_path": str(exported / "sql")})
    assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'extra' added successfully."
    ids = reference.encode(PROMPTS[2])
    r = client.completions.create(model="extra", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    decode = router.primary.engine.tokenizer.decode
    assert r.choices[0].text == decode(reference("sql", ids, 8), skip_special_tokens=True)
    again = httpx.post(url + "load_lora_adapter", json={"lora_name": "extra", "lora_path": str(exported / "sql")})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    swap = httpx.post(url + "load_lora_adapter", json={"lora_name": "extra", "lora_path": str(exported / "chat"),
                                                      "load_inplace": True})
    assert swap.status_code == 200
    r = client.completions.create(model="extra", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == decode(reference("chat", ids, 8), skip_special_tokens=True)
    missing = httpx.post(url + "load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "none")})
    assert missing.status_code == 404 and "No adapter found" in missing.json()["error"]["message"]
    bad = tmp_path / "bad"
    bad.mkdir()
    conf = json.loads((exported / "chat" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes((exported / "chat" / "adapter_model.safetensors").read_bytes())
    refused = httpx.post(url + "load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert refused.status_code == 400 and "use_dora" in refused.json()["error"]["message"]
    clash = httpx.post(url + "load_lora_adapter", json={"lora_name": router.primary.model_name, "lora_path": str(bad)})
    assert clash.status_code == 400
    assert httpx.post(url + "load_lora_adapter", json={"lora_name": "x"}).status_code == 400  # no lora_path

    gone = httpx.post(url + "unload_lora_adapter", json={"lora_name": "extra"})
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'extra' removed successfully."
    assert "extra" not in {m.id for m in client.models.list().data}
    twice = httpx.post(url + "unload_lora_adapter", json={"lora_name": "extra"})
    assert twice.status_code == 404 and twice.json()["error"]["message"] == "The lora adapter 'extra' cannot be found."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="extra", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2)


def test_load_endpoints_are_off_unless_asked(served):
    """As vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: the routes do not exist."""
    with ServerThread(build_app(served[1])) as srv:
        r = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert r.status_code == 404
