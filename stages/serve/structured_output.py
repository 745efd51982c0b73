"""Structured outputs (vLLM v1's structured_output/, in our words): a grammar per request, compiled
against the tokenizer's vocabulary; a matcher per request, advanced with every confirmed token; and
each step a token bitmask for the rows of the batch's logits that belong to constrained requests,
applied in place before sampling (rows of unconstrained requests are not touched). A request ends
when its grammar terminates (request.py), whatever max_tokens or ignore_eos say.

The backend is xgrammar, vLLM's default, so a schema, a regex or an EBNF grammar means here what it
means to a vLLM user. It installs from PyPI beside our torch (it pulls triton, used only by its CUDA
mask kernel); its matcher rolls back, so the draft tokens of speculative decoding are checked
against the grammar and the matcher restored, and constrained rows keep speculating; its structural
tags describe tool-call formats (tools.py). llguidance would have installed too (no dependencies at
all, lazy masks), but it is not what vLLM users get by default.

Speculative rows: the mask of verification row j is the grammar's state after drafts 0..j-1. Past
the first draft the grammar refuses, rows keep an all-allowed mask: the target gives that draft
probability 0 (its row is masked), so rejection sampling never accepts it and never reaches the
rows after it (speculative.py), and greedy verification stops there too.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

MAX_WHITESPACE_RUN = 16
"""Longest run of whitespace characters a JSON grammar allows between tokens (xgrammar's
max_whitespace_cnt) unless the request disables free whitespace altogether. Unbounded, a weak model
fills JSON with whitespace (a code tokenizer has dozens of indentation tokens, each allowed
wherever the grammar allows one space); 16 still lets a pretty-printed document put a newline and
three levels of four-space indentation between two tokens."""

GRAMMAR_CACHE_BYTES = 512 * 2**20
"""Compiled grammars kept for reuse (vLLM's default xgrammar cache size, 512 MiB)."""

RECENT_GRAMMARS = 64
"""Specs whose compiled grammars are kept by their text (GrammarBackend.compile), validation included."""


@dataclass
class StructuredOutput:
    """What one request's output must match: exactly one of json, json_object, regex, choice,
    grammar and structural_tag (vLLM's StructuredOutputsParams)."""

    json: dict | bool | None = None
    """A JSON schema the output must validate against."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format json_object)."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar: xgrammar's EBNF (GBNF-like, root rule `root`), or Lark."""
    structural_tag: str | dict | None = None
    """An xgrammar structural tag (JSON): tagged regions, each with its own format (tool calls)."""
    any_whitespace: bool = True
    """JSON grammars allow free whitespace between tokens (bounded by MAX_WHITESPACE_RUN); False
    emits compact JSON (vLLM's disable_any_whitespace)."""
    origin: str = field(default="structured_outputs", compare=False)
    """The request field it came from, for error messages."""

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "structural_tag")
                if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
        if len(set_) != 1:
            raise ValueError(f"{self.origin}: give exactly one of json, json_object, regex, choice, grammar or "
                             f"structural_tag, got {set_ or 'none'}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"{self.origin}: choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise ValueError(f"{self.origin}: {name} must be a non-empty string, got {v!r}")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"{self.origin}: json must be a JSON schema object, got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
                    if getattr(self, k) not in (None, False))


def _clean(err: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and a source location: keep the message."""
    text = str(err).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text).strip() or type(err).__name__


_NOT_SCHEMAS = frozenset({"const", "enum", "default", "examples"})  # keywords whose values are data


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of `schema` whose length-bounded strings (minLength/maxLength, no pattern or format)
    say the same bound as a pattern. xgrammar 0.2.9 turns a length bound into a repetition of a bare
    character class that lets raw control characters into the string and no escapes
    (mlc-ai/xgrammar#800, open), so a strict JSON parser rejects some outputs; its pattern path
    builds a proper JSON string. The pattern counts code points of the decoded string, as
    minLength/maxLength do."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _NOT_SCHEMAS else bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    types = out.get("type", "string")
    stringy = types == "string" or isinstance(types, list) and "string" in types  # a pattern binds strings only
    if stringy and bounded and "pattern" not in out and "format" not in out:
        lo, hi = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = "^[\\s\\S]{%d,%s}$" % (lo, "" if hi is None else int(hi))
    return out


def check_json_schema(schema: Any, origin: str) -> None:
    """A 400 naming the problem when `schema` is not a valid JSON schema (its metaschema says which
    keyword is wrong): xgrammar alone reports only what it cannot convert."""
    import jsonschema

    if isinstance(schema, bool):
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ValueError(f"{origin}: invalid JSON schema" + (f" at '{where}'" if where else "")
                         + f": {e.message}") from None


class GrammarBackend:
    """Compiles a request's StructuredOutput into a grammar over one tokenizer's vocabulary
    (`vocab_size`: the model's, which may pad the tokenizer's) and makes its matcher."""

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # one thread: the engine shares the machine's cores with the forward; compiled grammars cached
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True,
                                            cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self._recent: dict[str, Any] = {}  # spec's canonical text -> compiled grammar, oldest first

    def compile(self, spec: StructuredOutput):
        """The compiled grammar; ValueError naming the request field and the problem otherwise.
        Kept by the spec's canonical text: a load repeating one schema checks and converts it once
        (checking a schema against its metaschema took 7 ms, a fifth of a json_schema load's time)."""
        key = json.dumps([spec.kind, getattr(spec, spec.kind), spec.any_whitespace], sort_keys=True, default=str)
        compiled = self._recent.get(key)
        if compiled is None:
            compiled = self._compile(spec)
            if len(self._recent) >= RECENT_GRAMMARS:
                self._recent.pop(next(iter(self._recent)))  # the oldest
            self._recent[key] = compiled
        return compiled

    def _compile(self, spec: StructuredOutput):
        xgr, c = self._xgr, self.compiler
        ws = {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE_RUN} if spec.any_whitespace \
            else {"any_whitespace": False}
        kind = spec.kind
        try:
            if kind == "json":
                check_json_schema(spec.json, spec.origin)
                return c.compile_json_schema(json.dumps(bounded_strings_as_patterns(spec.json)), **ws)
            if kind == "json_object":  # vLLM's reading of json_object: any object, not any JSON value
                return c.compile_json_schema('{"type": "object"}', **ws)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                from xgrammar.structural_tag import ConstStringFormat, OrFormat, StructuralTag

                # literal strings, so no escaping into a regex or an EBNF literal can go wrong
                fmt = OrFormat(elements=[ConstStringFormat(value=v) for v in spec.choice])
                return c.compile_structural_tag(StructuralTag(format=fmt))
            if kind == "grammar":
                return self._compile_grammar(spec.grammar)
            tag = spec.structural_tag
            return c.compile_structural_tag(xgr.StructuralTag.from_json(tag))
        except ValueError as e:
            if str(e).startswith(spec.origin):
                raise
            raise ValueError(f"{spec.origin}: invalid {kind}: {_clean(e)}") from None
        except (RuntimeError, TypeError) as e:  # xgrammar's parse and conversion errors
            raise ValueError(f"{spec.origin}: invalid {kind}: {_clean(e)}") from None

    def _compile_grammar(self, text: str):
        """EBNF first (vLLM's guided_grammar with xgrammar); a grammar that is not EBNF may be Lark."""
        try:
            return self.compiler.compile_grammar(text)
        except RuntimeError as ebnf_error:
            try:
                return self.compiler.compile_lark(text)
            except RuntimeError:
                raise ebnf_error from None

    def matcher(self, spec: StructuredOutput, stop_token_ids: list[int]):
        """A fresh matcher: the grammar's end is followed by one of `stop_token_ids` (the request's
        EOS and stop tokens), which terminates it."""
        compiled = self.compile(spec)
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)


class GrammarBitmask:
    """Masks, in place, the logits rows of constrained requests in one step's batch."""

    def __init__(self, vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self._buf = xgr.allocate_token_bitmask(64, vocab_size)
        # one C++ call fills the masks of every request without drafts (half the time of one call
        # each at 32 requests); on the engine's threads, which the model's step is not using then
        self._batch = xgr.BatchGrammarMatcher(max_threads=torch.get_num_threads())

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, Any, list[int]]]) -> None:
        """`rows`: (first logits row, request, draft tokens) for each constrained request that
        samples this step; its rows are the first and one per draft token."""
        n = logits.shape[0]
        if self._buf.shape[0] < n:
            self._buf = self._xgr.allocate_token_bitmask(max(n, 2 * self._buf.shape[0]), self.vocab_size)
        bitmask = self._buf[:n]
        indices: list[int] = []
        plain: list[Any] = []  # matchers of requests without drafts, and their rows: filled in one batch below
        plain_rows: list[int] = []
        for first, req, drafts in rows:
            m = req.grammar
            if m.is_terminated():
                continue
            indices.append(first)
            if not drafts:
                plain.append(m)
                plain_rows.append(first)
                continue
            m.fill_next_token_bitmask(bitmask, first)
            accepted = 0
            for j, tok in enumerate(drafts):
                if not m.accept_token(tok):
                    break  # the rows past it are never reached (module docstring)
                accepted += 1
                if m.is_terminated():
                    break
                m.fill_next_token_bitmask(bitmask, first + j + 1)
                indices.append(first + j + 1)
            if accepted:
                m.rollback(accepted)
        if plain:
            self._batch.batch_fill_next_token_bitmask(plain, bitmask, plain_rows)
        if indices:
            if logits.device.type != "cpu":
                bitmask = bitmask.to(logits.device, non_blocking=True)
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)
