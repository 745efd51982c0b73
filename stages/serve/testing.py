"""A tiny Hugging Face Llama checkpoint built deterministically on the spot, for tests and the
serving benchmark: random weights (so text is repetitive, which is fine for speed and equality
checks) and a byte-level BPE tokenizer trained on the standard library's own source."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]


def _stdlib_text(max_bytes: int) -> list[str]:
    """A fixed, sorted slice of the standard library's .py files (deterministic on one Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def make_tokenizer(out_dir: str | Path, vocab_size: int = 1024, max_bytes: int = 1_500_000):
    """Train a byte-level BPE on stdlib source and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_text(max_bytes), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def make_llama(
    out_dir: str | Path,
    *,
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    from_model=None,
    late_layer_scale: float = 1.0,
):
    """Save a random LlamaForCausalLM (or, with `from_model`, its first `num_layers` layers: a
    draft that shares embeddings and head with the target). `late_layer_scale` shrinks the output
    projections of every layer after the first, so those layers refine rather than overturn the
    first layer's prediction - the relation between a model and a good draft of it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    if late_layer_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.self_attn.o_proj.weight.mul_(late_layer_scale)
                layer.mlp.down_proj.weight.mul_(late_layer_scale)
    if from_model is not None:
        src = from_model.state_dict()
        own = model.state_dict()
        model.load_state_dict({k: src[k].clone() for k in own})
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def train_briefly(model, tokenizer, steps: int, seq_len: int = 128, batch_size: int = 16, lr: float = 3e-3,
                  seed: int = 0, teacher=None) -> list[float]:
    """A few hundred AdamW steps of next-token prediction on stdlib source: enough for a tiny model
    to pick up code's repetitiveness (what an exported model brings to a benchmark), not to be good.
    With `teacher`, the loss is KL(teacher || model) instead: a draft distilled from its target."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(tokenizer.encode("\n".join(_stdlib_text(1_500_000)), add_special_tokens=False))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=g)
        x = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
        if teacher is None:
            loss = model(input_ids=x, labels=x).loss
        else:
            with torch.no_grad():
                target_lp = torch.log_softmax(teacher(input_ids=x).logits.float(), -1)
            lp = torch.log_softmax(model(input_ids=x).logits.float(), -1)
            loss = torch.nn.functional.kl_div(lp, target_lp, log_target=True, reduction="batchmean") / seq_len
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    model.eval()
    return losses


def make_tiny_checkpoint(out_dir: str | Path, *, draft_dir: str | Path | None = None, vocab_size: int = 1024,
                         num_layers: int = 4, hidden_size: int = 128, seed: int = 0, train_steps: int = 0) -> Path:
    """Write tokenizer + Llama into `out_dir` (and a 1-layer draft into `draft_dir`).

    train_steps=0: random weights, the target's later layers scaled down so that its first layer,
    which is the draft, agrees with it often (tests). train_steps>0: target and draft each trained
    briefly on stdlib code (the benchmark: its outputs repeat like a code model's do)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").exists() and (draft_dir is None or (Path(draft_dir) / "config.json").exists()):
        return out
    tok = make_tokenizer(out, vocab_size=vocab_size)
    target = make_llama(out, vocab_size=vocab_size, num_layers=num_layers, hidden_size=hidden_size, seed=seed,
                        late_layer_scale=0.1 if not train_steps else 1.0)
    losses = {}
    if train_steps:
        losses["target"] = train_briefly(target, tok, train_steps, seed=seed)[-10:]
        target.save_pretrained(str(out), safe_serialization=True)
    if draft_dir is not None:
        d = Path(draft_dir)
        d.mkdir(parents=True, exist_ok=True)
        make_tokenizer(d, vocab_size=vocab_size)
        draft = make_llama(d, vocab_size=vocab_size, num_layers=1, hidden_size=hidden_size, seed=seed,
                           from_model=None if train_steps else target)
        if train_steps:
            losses["draft"] = train_briefly(draft, tok, train_steps, seed=seed + 1, teacher=target)[-10:]
            draft.save_pretrained(str(d), safe_serialization=True)
    (out / "eightfold_fixture.json").write_text(json.dumps({"seed": seed, "vocab_size": vocab_size,
                                                            "train_steps": train_steps, "last_losses": losses}))
    return out
