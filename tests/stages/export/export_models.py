"""Helpers for the export tests (a uniquely named module, so `import` never picks another folder's
conftest): tiny configs, random and briefly trained models, token rows of standard-library source."""

from __future__ import annotations

import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from infra.config.model import ModelConfig

VOCAB = 512
SEQ = 64
FILES = ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py", "queue.py",
         "sched.py", "calendar.py", "difflib.py", "operator.py")


def stdlib_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(root / f).read_text(encoding="utf-8") for f in FILES]


@contextmanager
def single_thread():
    """These models are tiny: on a shared 2-core machine one intra-op thread is ~10x faster than two
    fighting other processes for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Trained:
    cfg: ModelConfig
    state_dict: dict[str, torch.Tensor]
    train_rows: torch.Tensor  # [N, SEQ + 1]
    val_rows: torch.Tensor  # [M, SEQ + 1] held out (the last file's tokens)


def token_rows(tokenizer_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = stdlib_texts()
    ids = [torch.tensor(tok.encode(t).ids) for t in texts]
    train, val = torch.cat(ids[:-2]), torch.cat(ids[-2:])
    n = SEQ + 1
    return train[: len(train) // n * n].view(-1, n), val[: len(val) // n * n].view(-1, n)


def tiny_cfg(**kw) -> ModelConfig:
    # dim and ffn are multiples of 128 so every linear has whole INT4 groups of 128 inputs
    base = dict(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=128)
    return ModelConfig(**{**base, **kw})


def train_briefly(cfg: ModelConfig, train: torch.Tensor, val: torch.Tensor) -> Trained:
    from trainer.model import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):  # a few seconds: validation perplexity ~140, against 512 for a uniform guess
        batch = train[torch.randint(0, train.shape[0], (16,), generator=g)]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Trained(cfg, sd, train, val[:8])


def random_model_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random model with non-trivial norm weights (all-ones norms would hide a norm mix-up)."""
    from trainer.model import Transformer

    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.2 * torch.randn_like(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
