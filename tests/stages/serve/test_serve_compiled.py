"""The compiled all-decode step (enforce_eager=False) generates what the eager engine generates,
compiles only at engine start, and really runs compiled."""

from __future__ import annotations

import pytest
import torch._dynamo

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams


@pytest.mark.slow
def test_compiled_engine_generates_what_the_eager_one_does(tiny_hf_model_dir):
    # repetitive prompts: n-gram speculation proposes drafts, so steps verify 1 + k tokens per
    # sequence in the compiled step too, alongside plain decodes (1 token) and eager mixed steps
    prompts = [[5 + (j % (3 + i)) for j in range(12 + 5 * i)] for i in range(5)] + [[7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # as many slots as prompts: steps where every slot decodes (a shape warm-up does not make) must
    # not compile on the request path either
    cfg = dict(num_kv_blocks=64, max_num_seqs=len(prompts))
    eager = LLMEngine(tiny_hf_model_dir, EngineConfig(**cfg))
    assert not eager.model.pieces.compiled
    want = [o.token_ids for o in eager.generate(prompts, params)]

    compiled = LLMEngine(tiny_hf_model_dir, EngineConfig(enforce_eager=False, speculative="ngram",
                                                         num_speculative_tokens=3, **cfg))
    pieces = compiled.model.pieces
    assert pieces.compiled and compiled.compile_seconds > 0
    warm_calls = pieces.num_calls
    with torch._dynamo.config.patch(error_on_recompile=True):  # warm-up compiled every variant
        got = [o.token_ids for o in compiled.generate(prompts, params)]
        assert compiled.model.pieces is pieces, "the compiled step failed and fell back to eager"
        assert pieces.num_calls > warm_calls + 5, "no all-decode step ran compiled"
        assert compiled.metrics.spec_accepted.value(model_name=compiled.model_name) > 0
        assert got == want
        # one request alone (a batch of one: its own compiled variant), after the prefix cache is dropped
        compiled.reset_prefix_cache()
        assert compiled.generate(prompts[1:2], params)[0].token_ids == want[1]


def _staggered(engine, prompts, params, joins) -> list[list[int]]:
    """Add prompts in waves (`joins[i]`: how many join before step i) while earlier ones decode;
    returns each prompt's tokens."""
    waiting, ids, done, step = list(prompts), [], {}, 0
    while waiting or engine.has_unfinished():
        n = joins.get(step, 0 if engine.has_unfinished() else len(waiting))
        ids += [engine.add_request(p, params) for p in waiting[:n]]
        del waiting[:n]
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        step += 1
    return [done[r] for r in ids]


@pytest.mark.slow
def test_prompts_joining_a_decoding_batch_prefill_in_the_compiled_step(tiny_hf_model_dir, monkeypatch):
    import stages.serve.runner as runner

    prompts = [[3 + (7 * i + 5 * j) % 90 for j in range(6 + 9 * i)] for i in range(7)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    cfg = dict(num_kv_blocks=64, max_num_seqs=8)
    joins = {0: 3, 4: 2, 9: 1, 10: 1}  # two prompts join three decodes at once, then one at a time
    want = _staggered(LLMEngine(tiny_hf_model_dir, EngineConfig(**cfg)), prompts, params, joins)

    compiled = LLMEngine(tiny_hf_model_dir, EngineConfig(enforce_eager=False, **cfg))
    joined = []
    run_decodes = runner.run_decodes
    monkeypatch.setattr(runner, "run_decodes", lambda *a, prompts=None, **k: (
        joined.append(len(prompts or [])), run_decodes(*a, prompts=prompts, **k))[1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _staggered(compiled, prompts, params, joins)
    assert compiled.model.pieces.compiled, "the compiled step failed and fell back to eager"
    assert sorted(n for n in joined if n) == [1, 1, 2], joined  # every join rode a compiled decode step
    assert got == want


def test_serve_compiles_by_default_and_enforce_eager_turns_it_off(monkeypatch):
    import stages.serve.server as server
    from stages.serve.cli import main

    seen = []
    monkeypatch.setattr(server, "serve_command", lambda model_dir, *a, **options: seen.append(options) or 0)
    cases = [(["serve", "m"], False), (["serve", "m", "--enforce-eager"], True),
             (["serve", "m", "--enforce-eager", "false"], False), (["serve", "m", "--max-num-seqs", "8"], False)]
    for argv, want in cases:
        assert main(argv) == 0
        assert seen[-1]["enforce_eager"] is want, argv
    assert seen[-1]["max_num_seqs"] == 8 and seen[-1]["prefill_replicas"] == 0
    assert main(["serve", "m", "--prefill-replicas", "2"]) == 0 and seen[-1]["prefill_replicas"] == 2
    with pytest.raises(SystemExit):  # not a boolean
        main(["serve", "m", "--enforce-eager", "maybe"])
    assert EngineConfig().enforce_eager is True  # engines built in-process (evaluate, GRPO) stay eager


@pytest.mark.parametrize("working_calls", [0, 3])
def test_a_compile_that_fails_falls_back_to_eager_with_the_same_tokens(tiny_hf_model_dir, monkeypatch, working_calls):
    """torch.compile stood in by a wrapper that runs the layer pass eagerly for `working_calls` calls
    and then raises as a failing compiler would: during the warm-up (0) the engine starts eager;
    after it (3: the warm-up's variants without speculation) the failing step is redone eagerly and
    the engine runs eager from then on. Either way the tokens are the eager engine's."""
    import stages.serve.compiled_forward as compiled_forward
    from stages.serve.layer_pass import LayerPass

    prompts = [[5 + (j % (3 + i)) for j in range(12 + 5 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = dict(num_kv_blocks=64, max_num_seqs=8)
    want = [o.token_ids for o in LLMEngine(tiny_hf_model_dir, EngineConfig(**cfg)).generate(prompts, params)]

    calls = []

    def failing_compile(fn):
        def run(*args):
            calls.append(len(args))
            if len(calls) > working_calls:
                raise RuntimeError("inductor: no C++ compiler")
            return fn(*args)
        return run

    monkeypatch.setattr(compiled_forward.torch, "compile", failing_compile)
    engine = LLMEngine(tiny_hf_model_dir, EngineConfig(enforce_eager=False, **cfg))
    assert engine.model.pieces.compiled is bool(working_calls) and (engine.compile_seconds > 0) is bool(working_calls)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert type(engine.model.pieces) is LayerPass and len(calls) == working_calls + 1
    assert got == want
