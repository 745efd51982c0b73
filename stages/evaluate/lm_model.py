"""`eightfold` as an lm-evaluation-harness model: `lm_eval.simple_evaluate(model="eightfold",
model_args="pretrained=DIR")` runs any task on our serving engine.

Tokenisation, context truncation, rolling windows and stop handling follow lm-eval's own `hf` model
step for step (TemplateLM's context/continuation split, `get_rolling_token_windows` with
context_len=1 and the BOS-or-EOS prefix token, left truncation to `max_length`), so that with the
same `max_length` both give the same numbers on the same checkpoint - the cross-check in the tests.
"""

from __future__ import annotations

from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text

from .backends import Backend, GenerationRequest, make_backend


def _opt(value: Any, kind: type, name: str):
    """lm-eval passes model_args as strings ("pretrained=x,batch_size=8"): coerce, naming bad values."""
    if value is None or isinstance(value, kind):
        return value
    try:
        if kind is bool:
            return str(value).lower() in ("1", "true", "yes")
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"eightfold model argument {name}={value!r} is not a {kind.__name__}") from None


@register_model("eightfold")
class EightfoldLM(TemplateLM):
    def __init__(
        self,
        pretrained: str | None = None,
        backend: str | Backend = "engine",
        batch_size: int | str | None = 16,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        dtype: str = "float32",
        device: str | None = None,
        prefix_token_id: int | None = None,
        add_bos_token: bool | None = None,
        max_batch_size: int | None = None,  # lm-eval passes it; batching is the engine's job
        **engine_options: Any,
    ) -> None:
        super().__init__()
        if isinstance(backend, str):
            if not pretrained:
                raise ValueError("the eightfold model needs pretrained=<Hugging Face folder> (or a backend object)")
            self.backend: Backend = make_backend(backend, pretrained, dtype=dtype, device=device or "cpu",
                                                 **engine_options)
        else:
            self.backend = backend
        self.tokenizer = self.backend.tokenizer
        bs = batch_size if batch_size not in (None, "auto") else 16
        self._batch_size = max(1, int(str(bs).split(":")[0]))
        limit = _opt(max_length, int, "max_length")
        if limit is not None and limit > self.backend.max_length:
            raise ValueError(f"max_length={limit} exceeds what the backend can score ({self.backend.max_length})")
        self._max_length = limit or self.backend.max_length
        self._max_gen_toks = _opt(max_gen_toks, int, "max_gen_toks")
        self.custom_prefix_token_id = _opt(prefix_token_id, int, "prefix_token_id")
        self.add_bos_token = _opt(add_bos_token, bool, "add_bos_token")
        self.pretrained = pretrained

    # -- what TemplateLM asks for ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "eightfold")).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt as the tokenizer's chat template renders it (lm-eval's --apply_chat_template)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.pretrained}: the tokenizer has no chat template (evaluate.apply_chat_template)")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **extra)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- scoring -------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's base class draws a "Tokenizing inputs" bar over a step that takes milliseconds here
        return super().loglikelihood(requests, disable_tqdm=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids). Sequences longer
        than max_length + 1 lose tokens on the left, as in lm-eval's `hf` model."""
        pairs = []
        for _, ctx, cont in requests:
            if not cont:
                raise ValueError("a loglikelihood request with an empty continuation")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            if len(cont) >= len(whole):
                raise ValueError(f"continuation of {len(cont)} tokens does not fit max_length={self.max_length}")
            pairs.append((whole[: len(whole) - len(cont)], whole[len(whole) - len(cont):]))
        results: list[tuple[float, bool]] = []
        for i in range(0, len(pairs), self.batch_size):
            results.extend(self.backend.score(pairs[i:i + self.batch_size]))
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents over disjoint windows of max_length tokens, each after one
        token of context (the prefix token for the first window), as lm-eval's `hf` model does."""
        windows, counts = [], []
        for (string,) in [r.args for r in requests]:
            doc = [
                lm_utils.make_disjoint_window(w)
                for w in lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1,
                )
            ]
            windows.extend((None, ctx, cont) for ctx, cont in doc)
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows)
        out, pos = [], 0
        for r, n in zip(requests, counts):
            total = sum(s for s, _ in scores[pos:pos + n])
            pos += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return out

    # -- generation ------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        gens: list[GenerationRequest] = []
        for context, gen_kwargs in [r.args for r in requests]:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_tokens = kwargs.pop("max_gen_toks")
            room = self.max_length - max_tokens
            if room <= 0:
                raise ValueError(f"max_gen_toks={max_tokens} leaves no room for a prompt in max_length={self.max_length}")
            ids = self.tok_encode(context)[-room:]
            temperature = float(kwargs.get("temperature", 0.0) or 0.0) if kwargs.get("do_sample") else 0.0
            gens.append(GenerationRequest(ids, max_tokens, until, temperature, float(kwargs.get("top_p", 1.0) or 1.0),
                                          kwargs.get("seed")))
        texts: list[str] = []
        for i in range(0, len(gens), self.batch_size):
            texts.extend(self.backend.generate(gens[i:i + self.batch_size]))
        out = []
        for r, g, text in zip(requests, gens, texts):
            text = postprocess_generated_text(text, g.until, None)
            self.cache_hook.add_partial("generate_until", r.args, text)
            out.append(text)
        return out
