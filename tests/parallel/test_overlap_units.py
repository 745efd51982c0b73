"""The overlap's pieces in one process: when a bucket counts as complete (grad_ready.py) and which unit
waits for which gathered bucket (param_ready.py)."""

import pytest
import torch
from torch import nn

from infra.config.model import ModelConfig
from trainer.loss import can_fuse_head
from trainer.model import Transformer
from trainer.parallel.grad_ready import GradReadiness
from trainer.parallel.param_ready import owners, register_param_waits


def tiny() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32,
                                   max_seq_len=16))


def test_bucket_launches_at_its_last_gradient_of_the_armed_passes():
    model = tiny()
    params = [p for p in model.parameters()]
    buckets = [params[:1], params[1:]]  # the embedding alone: the last gradient of backward
    launched: list[int] = []
    ready = GradReadiness(buckets, launched.append)
    tokens = torch.randint(0, 64, (2, 8))
    model(tokens).sum().backward()  # not armed: accumulation only
    assert launched == []
    ready.arm(2)
    model(tokens).sum().backward()
    assert launched == []  # one of two passes
    model(tokens).sum().backward()
    # the layers' bucket first (backward runs from the head), then the embedding's
    assert launched == [1, 0] and ready.unlaunched() == []
    with pytest.raises(RuntimeError, match="already sent"):
        model(tokens).sum().backward()
    ready.reset()
    model(tokens).sum().backward()  # disarmed again
    assert len(launched) == 2
    with pytest.raises(ValueError):
        ready.arm(0)


def test_unit_waits_and_the_head_stays_fused():
    model = tiny()
    owner = owners(model)
    assert owner[id(model.embed_tokens.weight)] is model.embed_tokens
    assert owner[id(model.layers["1"].mlp.up_proj.weight)] is model.layers["1"]
    assert owner[id(model.lm_head.weight)] is model.norm  # read by the fused loss without its forward
    params = list(model.parameters())
    buckets = [params[:1], params[1:-2], params[-2:]]  # embedding; the layers; norm + head
    waited: list[list[int]] = []
    everything: list[bool] = []
    register_param_waits(model, buckets, waited.append, lambda: everything.append(True))
    assert can_fuse_head(model.lm_head, torch.zeros(1))  # no hook on the head
    model(torch.randint(0, 64, (1, 4)))
    # the embedding waits for bucket 0, layer 0 for bucket 1 (its first unit), the norm for the head's bucket
    assert waited == [[0], [1], [1], [2]]
    model.state_dict()
    model.load_state_dict(model.state_dict())
    assert len(everything) == 3
    assert isinstance(model.lm_head, nn.Linear) and not model.lm_head._forward_pre_hooks
