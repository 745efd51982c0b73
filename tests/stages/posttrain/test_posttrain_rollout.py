"""GRPO's rollout engine is the serving engine: its greedy answers match our model's, pushing new
weights changes its generations (and resets the prefix cache), pushing the old ones back restores
them; sampled rollouts carry the behaviour policy's log-probs: those of the distribution sampled from,
softmax(logits / temperature) (the engine's processed_logprobs), which GRPO's ratio needs."""

import pytest
import torch

from fixtures.posttrain import make_chat_tokenizer, posttrain_config
from stages.posttrain.rollout import ServingEngineRollouts
from trainer import posttrain_data as pdata
from trainer.model import Transformer
from trainer.posttrain_job import stop_token_ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    tok_dir = make_chat_tokenizer(root / "tok")
    cfg = posttrain_config()
    torch.manual_seed(0)
    a = Transformer(cfg.model).state_dict()
    torch.manual_seed(1)
    b = Transformer(cfg.model).state_dict()
    tok = pdata.load_tokenizer(tok_dir)
    engine = ServingEngineRollouts(model_cfg=cfg.model, state_dict=a, tokenizer_dir=tok_dir, workdir=root / "engine",
                                   stop_token_ids=stop_token_ids(tok))
    prompts = [pdata.prompt_ids(tok, {"messages": [{"role": "user", "content": f"Q: What is {i} + 2?\nA:"}]})
               for i in range(4)]
    return cfg, engine, a, b, prompts


def _greedy_ours(cfg, sd, prompt, n):
    model = Transformer(cfg.model)
    model.load_state_dict(sd)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_weights_pushed_to_the_engine_change_its_generations(setup):
    cfg, engine, a, b, prompts = setup
    first = [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)]
    assert first[0][:6] == _greedy_ours(cfg, a, prompts[0], 6)[:len(first[0])]
    pushes = engine.pushes
    engine.update_weights(b)
    assert engine.pushes == pushes + 1 and engine.engine.kv.usage() >= 0
    second = [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)]
    assert second != first
    assert second[0] == _greedy_ours(cfg, b, prompts[0], 6)[:len(second[0])]
    engine.update_weights(a)
    assert [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)] == first


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_groups_carry_logprobs(setup, temperature):
    cfg, engine, a, _, prompts = setup
    engine.update_weights(a)
    groups = engine.generate(prompts[:2], 3, 5, temperature=temperature, seed=7)
    assert [len(g) for g in groups] == [3, 3]
    r = groups[1][2]
    assert r.prompt_ids == prompts[1] and len(r.logprobs) == len(r.completion_ids) >= 1
    model = Transformer(cfg.model)
    model.load_state_dict(a)
    with torch.no_grad():
        seq = torch.tensor([r.prompt_ids + r.completion_ids])
        lp = torch.log_softmax(model(seq[:, :-1])[0] / temperature, -1)
    p = len(r.prompt_ids)
    ours = [lp[p - 1 + i, t].item() for i, t in enumerate(r.completion_ids)]
    assert r.logprobs == pytest.approx(ours, abs=1e-4)


def test_weights_are_copied_in_place_and_a_subset_is_enough(setup):
    """The engine keeps its tensors (same storage: compiled steps keep their addresses) and takes any subset
    of the weights; pushing only the changed ones equals pushing all of them."""
    cfg, engine, a, b, prompts = setup
    engine.update_weights(a)
    assert engine.copies_in_place
    first = [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)]
    model = engine.engine.model
    before = {n: t.data_ptr() for n, t in model.weight_views().items()}
    changed = {k: v for k, v in b.items() if k.startswith("layers.1.")}  # as if only layer 1 were trained
    engine.update_weights(changed)
    assert {n: t.data_ptr() for n, t in model.weight_views().items()} == before
    partial = [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)]
    assert partial != first  # the subset took effect
    engine.update_weights(a)
    engine.update_weights({**a, **changed})
    assert [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)] == partial
    with pytest.raises(KeyError, match="no tensor 'model.nonsense.weight'"):
        engine.update_weights({"nonsense.weight": torch.zeros(1)})


def test_a_lora_trainer_syncs_its_adapter_alone(setup, tmp_path):
    """With LoRA the engine keeps the base weights and loads the trainer's adapter (PEFT files, a fraction of
    the model's bytes); its generations are the merged model's, and a second load replaces the first."""
    from trainer.lora import apply_lora, merged_state_dict, save_peft

    cfg, engine, a, _, prompts = setup
    engine.update_weights(a)
    base = [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)]
    model = Transformer(cfg.model)
    model.load_state_dict(a)
    apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    torch.manual_seed(3)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)  # a trained adapter: B is 0 only at the start
    folder = save_peft(model, tmp_path / "adapter")
    engine.load_adapter(folder)
    adapted = [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)]
    assert adapted != base
    merged = merged_state_dict(model)
    assert adapted[0] == _greedy_ours(cfg, merged, prompts[0], 6)[:len(adapted[0])]
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.zero_()  # B = 0: the adapter adds nothing
    engine.load_adapter(save_peft(model, tmp_path / "adapter"))
    assert [r[0].completion_ids for r in engine.generate(prompts, 1, 6, temperature=1e-6, seed=0)] == base
    engine.lora_name = None
    engine.engine.unload_lora("policy")
