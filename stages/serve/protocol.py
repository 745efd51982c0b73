"""The request bodies of the OpenAI-compatible API, as vLLM accepts them
(vllm/entrypoints/openai/protocol.py): OpenAI's fields, vLLM's sampling extensions (top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output, ignore_eos,
prompt_logprobs...), chat messages in all five roles with content as a string or a list of text
parts, and tool calls. Fields this server does not know are accepted and logged as a warning, as
vLLM does. The structured-output and tool-choice fields (`response_format`, `structured_outputs`,
`guided_*`; `tools`, `tool_choice`, `parallel_tool_calls`) are typed and turned into the engine's
constraint by structured_requests.py; `tools` also reaches the chat template, which renders them."""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .sampling import SamplingParams
from .structured_requests import StructuredOutputFields, ToolFields, structured_output_of

log = logging.getLogger("stages.serve.protocol")

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's documented range of a bias: [-100, 100]


class OpenAIBaseModel(BaseModel):
    """Unknown fields are kept and logged, never refused (vLLM's OpenAIBaseModel)."""

    model_config = ConfigDict(extra="allow")
    _field_names: ClassVar[set[str] | None] = None

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            extra = set(data) - known
            if extra:
                log.warning("The following fields were present in the request but ignored: %s", sorted(extra))
        return result


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(OpenAIBaseModel, StructuredOutputFields):
    """What /v1/completions and /v1/chat/completions share: the model, sampling, stopping and the
    output's constraint (StructuredOutputFields)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, v):
        if v is None:
            return v
        for k in v:
            try:
                int(k)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                        vocab_size: int) -> SamplingParams:
        """vLLM's defaults for what the request leaves out (temperature 1, top_p 1, no top-k...).
        Raises ValueError (a 400) naming a field the engine cannot honour, or an output constraint
        that is invalid or combined with another (structured_requests.py)."""
        bias = {}
        for k, b in (self.logit_bias or {}).items():
            tid = int(k)
            if not 0 <= tid < vocab_size:
                raise ValueError(f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab_size})")
            bias[tid] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))
        bad_stop = [t for t in self.stop_token_ids or [] if not 0 <= t < vocab_size]
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop[:5]} are outside the vocabulary [0, {vocab_size})")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=bias,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_output=structured_output_of(self),
        )


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best are known only at the end)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(OpenAIBaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        for i, part in enumerate(v if isinstance(v, list) else []):
            if part.get("type") != "text":
                raise ValueError(f"content part {i} has type {part.get('type')!r}: this model reads text parts only")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} (type text) needs a string 'text'")
        return v

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content"
                             + (" (or tool_calls)" if self.role == "assistant" else ""))
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention, as vLLM passes it):
        text parts joined by newlines, tool-call arguments as a JSON object rather than a string."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "\n".join(p["text"] for p in self.content)
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"tool call {c.function.name!r}: arguments are not JSON ({e})") from None
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            out["tool_calls"] = calls
        return out


class ChatRequest(SamplingRequest, ToolFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _generation_prompt(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's tool objects)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's /v1/load_lora_adapter (vllm/entrypoints/serve/lora/protocol.py): `load_inplace` swaps the
    weights of an adapter already loaded under that name."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; adapters are found by name here
