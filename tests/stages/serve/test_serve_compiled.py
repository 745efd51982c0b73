"""The compiled all-decode step (enforce_eager=False) generates what the eager engine generates,
compiles only at engine start, and really runs compiled."""

from __future__ import annotations

import pytest
import torch._dynamo

from stages.serve.engine import EngineConfig, LLMEngine
from stages.serve.sampling import SamplingParams


@pytest.mark.slow
def test_compiled_engine_generates_what_the_eager_one_does(tiny_hf_model_dir, monkeypatch):
    # repetitive prompts: n-gram speculation proposes drafts, so steps verify 1 + k tokens per
    # sequence in the compiled step too, alongside plain decodes (1 token) and eager mixed steps
    prompts = [[5 + (j % (3 + i)) for j in range(12 + 5 * i)] for i in range(5)] + [[7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    cfg = dict(num_kv_blocks=64, max_num_seqs=8)
    eager = LLMEngine(tiny_hf_model_dir, EngineConfig(**cfg))
    assert not eager.model.pieces.compiled
    want = [o.token_ids for o in eager.generate(prompts, params)]

    compiled = LLMEngine(tiny_hf_model_dir, EngineConfig(enforce_eager=False, speculative="ngram",
                                                         num_speculative_tokens=3, **cfg))
    pieces = compiled.model.pieces
    assert pieces.compiled and compiled.compile_seconds > 0
    warm_calls = pieces.num_calls
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # warm-up compiled every variant
    got = [o.token_ids for o in compiled.generate(prompts, params)]
    assert compiled.model.pieces is pieces, "the compiled step failed and fell back to eager"
    assert pieces.num_calls > warm_calls + 5, "no all-decode step ran compiled"
    assert compiled.metrics.spec_accepted.value(model=compiled.model_name) > 0
    assert got == want
    # one request alone (a batch of one: its own compiled variant), after the prefix cache is dropped
    compiled.reset_prefix_cache()
    assert compiled.generate(prompts[1:2], params)[0].token_ids == want[1]


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
    assert seen[-1]["max_num_seqs"] == 8
    with pytest.raises(SystemExit):  # not a boolean
        main(["serve", "m", "--enforce-eager", "maybe"])
    assert EngineConfig().enforce_eager is True  # engines built in-process (evaluate, GRPO) stay eager
