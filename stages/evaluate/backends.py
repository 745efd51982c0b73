"""What the registered lm-eval model runs on: a small interface (`score`, `generate`) with two
implementations, the serving engine (the default: the same code as `eightfold serve`) and plain
transformers (an independent reference for tests and cross-checks). Both take token ids, so the
lm-eval side (lm_model.py) does all tokenisation once, the way lm-eval's own `hf` model does.

Window sizes: `max_length` is the longest input a scoring request feeds (lm-eval's convention: the
last scored token is a target, never an input). The engine scores a continuation through its prompt
logprobs with one generated token, so a whole sequence of L+1 tokens needs L+2 positions: its
default max_length is the context length less 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    until: list[str] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


class Backend(Protocol):
    tokenizer: object
    max_length: int

    def score(self, requests: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation | context) and whether greedy decoding gives exactly the continuation."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[str]:
        """Generated text of each request, cut before the first stop string."""


def _cut(text: str, until: list[str]) -> str:
    for s in until:
        if s:
            text = text.split(s)[0]
    return text


class EngineBackend:
    """The serving engine's in-process API (`LLMEngine.score` / `.generate`)."""

    def __init__(self, model_dir: str | Path | None = None, engine=None, **engine_options):
        from stages.serve.engine import EngineConfig, LLMEngine

        if engine is None:
            if model_dir is None:
                raise ValueError("EngineBackend needs a Hugging Face model folder or an engine")
            options = {k: v for k, v in engine_options.items() if v is not None}
            engine = LLMEngine(model_dir, EngineConfig.from_options(**options))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_length = engine.max_model_len - 2

    def score(self, requests):
        for ctx, cont in requests:
            if len(ctx) + len(cont) + 1 > self.max_model_len:
                raise ValueError(f"a scoring request of {len(ctx) + len(cont)} tokens does not fit the engine's "
                                 f"{self.max_model_len} positions (truncate to max_length={self.max_length})")
        return self.engine.score([(list(c), list(x)) for c, x in requests])

    def generate(self, requests):
        from stages.serve.sampling import SamplingParams

        params = [SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, seed=r.seed,
                                 stop=list(r.until)) for r in requests]
        outs = self.engine.generate([r.prompt_ids for r in requests], params)
        return [_cut(o.text, r.until) for o, r in zip(outs, requests)]


class TransformersBackend:
    """`transformers.AutoModelForCausalLM` one sequence at a time (no padding, so nothing to mask):
    slow, simple, and independent of the engine."""

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu", **_ignored):
        import torch
        from transformers import AutoTokenizer

        from stages.export.validate import load_causal_lm

        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = load_causal_lm(model_dir, getattr(torch, dtype)).to(device)
        self.max_length = int(self.model.config.max_position_embeddings)

    def score(self, requests):
        torch = self.torch
        out = []
        with torch.no_grad():
            for ctx, cont in requests:
                whole = list(ctx) + list(cont)
                inp = torch.tensor([whole[:-1]], device=self.device)
                logp = torch.log_softmax(self.model(inp).logits[0].float(), dim=-1)[-len(cont):]
                target = torch.tensor(cont, device=self.device)
                total = float(logp.gather(-1, target[:, None]).sum())
                out.append((total, bool((logp.argmax(-1) == target).all())))
        return out

    def generate(self, requests):
        torch = self.torch
        texts = []
        with torch.no_grad():
            for r in requests:
                inp = torch.tensor([r.prompt_ids], device=self.device)
                kwargs = {"do_sample": r.temperature > 0}
                if r.temperature > 0:
                    kwargs.update(temperature=r.temperature, top_p=r.top_p)
                    if r.seed is not None:
                        torch.manual_seed(r.seed)
                gen = self.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=r.max_tokens,
                                          pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                                          **kwargs)
                text = self.tokenizer.decode(gen[0, inp.shape[1]:].tolist(), skip_special_tokens=True)
                texts.append(_cut(text, r.until))
        return texts


def dequantized_weights(variant_dir: str | Path, base_dir: str | Path):
    """Float32 Hugging Face-named weights of a quantized variant, through the export stage's own reference
    readers: compressed-tensors folders (FP8, INT8, packed INT4) or a GGUF file (blocks dequantized, the
    RoPE row permutation undone). `base_dir` (the unquantized hf/ folder) supplies the architecture."""
    import json

    import torch

    from stages.export.hf import model_config_from_hf, read_safetensors, to_hf_state_dict
    from stages.export.quantize import dequantize_state_dict

    variant_dir, base_dir = Path(variant_dir), Path(base_dir)
    ggufs = sorted(variant_dir.glob("*.gguf"))
    if ggufs:
        from stages.export.gguf_export import read_gguf

        cfg, arch = model_config_from_hf(json.loads((base_dir / "config.json").read_text()))
        _, ours = read_gguf(ggufs[0])
        return to_hf_state_dict(ours, cfg, arch, torch.float32)
    conf = json.loads((variant_dir / "config.json").read_text())
    return dequantize_state_dict(read_safetensors(variant_dir), conf.get("quantization_config"), torch.float32)


def dequantized_engine_backend(variant_dir: str | Path, base_dir: str | Path, **engine_options) -> EngineBackend:
    """The serving engine over `base_dir`'s architecture and tokenizer, running a variant's dequantized
    weights (pushed with `update_weights`, as GRPO does): for layouts the engine does not load itself."""
    backend = EngineBackend(base_dir, **engine_options)
    backend.engine.update_weights(dequantized_weights(variant_dir, base_dir))
    return backend


def make_backend(kind: str, model_dir: str | Path, **options) -> Backend:
    if kind == "engine":
        return EngineBackend(model_dir, **options)
    if kind == "hf":
        return TransformersBackend(model_dir, **{k: v for k, v in options.items() if k in ("dtype", "device")})
    raise ValueError(f"unknown backend {kind!r}; known: engine, hf")
