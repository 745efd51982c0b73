"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, a seed per request, and
logprobs of the chosen token plus the top-n alternatives (OpenAI's `logprobs`).

Logprobs are those of the model's raw distribution (log_softmax of the logits), as vLLM reports
them by default; temperature, top-k and top-p shape only the distribution that is sampled from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .structured_output import StructuredOutput


@dataclass
class SamplingParams:
    """What one request asks of the sampler and of the stop checks."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability sums to at least top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 keeps all."""
    seed: int | None = None
    """Seeds this request's own generator, so its samples do not depend on its batch mates."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; they are not included in the text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (besides EOS)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Return the chosen token's logprob and this many top alternatives (0: chosen only)."""
    prompt_logprobs: int | None = None
    """Return the logprob of every prompt token (and this many top alternatives)."""
    structured_output: StructuredOutput | None = None
    """A grammar the output must match (JSON schema, regex, choice, EBNF, structural tag): sampling
    is masked to it and the request ends when it does (structured_output.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise ValueError(f"{name} must be between 0 and 20, got {v}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: temperature, then top-k, then top-p. [N, V] -> [N, V]."""
    x = logits.float() / max(params.temperature, 1e-6)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        p = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(p, dim=-1) - p) >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    return torch.softmax(x, dim=-1)


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def sample_rows(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """Token ids for the rows of one request's logits [N, V]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = processed_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # top-n alternatives (may include the chosen token)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> list[TokenLogprob]:
    """Logprob of `token_ids[i]` under row i of `logits`, with the top_n alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, token_ids.view(-1, 1)).squeeze(-1).tolist()
    tops: list[dict[int, float]] = [{} for _ in chosen]
    if top_n > 0:
        vals, idx = torch.topk(lp, top_n, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    return [TokenLogprob(t, c, top) for t, c, top in zip(token_ids.tolist(), chosen, tops)]


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax of each row [N, V] as Python ints. On CPU through numpy: torch's argmax over a short
    last dimension costs ~20x numpy's (66 vs 3.6 us for 32 x 1024), and both pick the first maximum."""
    if logits.device.type == "cpu":
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


class Sampler:
    """Samples one token per request from the last row of its logits: every greedy row in one
    argmax; rows sampling with the same params and no seed of their own in one multinomial call;
    seeded rows each from their own generator (their samples must not depend on batch mates)."""

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        n = logits.shape[0]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy) == n:
            return greedy_tokens(logits)
        out = [0] * n
        if greedy:
            for i, t in zip(greedy, greedy_tokens(logits[torch.tensor(greedy, device=logits.device)])):
                out[i] = t
        shared: dict[tuple, list[int]] = {}  # unseeded rows, grouped by what shapes their distribution
        for i, p in enumerate(params):
            if p.greedy:
                continue
            if generators[i] is None:
                shared.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
            else:
                out[i] = int(sample_rows(logits[i:i + 1], p, generators[i])[0])
        for rows in shared.values():
            idx = torch.tensor(rows, device=logits.device)
            for i, t in zip(rows, sample_rows(logits[idx], params[rows[0]], None).tolist()):
                out[i] = t
        return out
