"""`evaluate:` lm-evaluation-harness over every model variant: which tasks, how many examples, which
variants, the engine that runs them, and the gates that fail the stage."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Section

# The offline suite written by the stage itself (stages/evaluate/tasks/).
SUITE_TASKS = (
    "eightfold_heldout_ppl",
    "eightfold_arith",
    "eightfold_pyexpr",
    "eightfold_arith_mc",
    "eightfold_code_completion",
)


class VariantConfig(Section):
    """One model to evaluate: a Hugging Face folder given as `<input>:<relative path>` (an input
    artifact of the stage, e.g. `export:quantized/int8`) or as an absolute path."""

    name: str = Field(..., min_length=1, description="row name in the comparison table and in gates")
    path: str = Field(..., min_length=1, description="`export:hf`, `export:quantized/fp8`, or an absolute folder")


class GateConfig(Section):
    """One condition on one variant's metric. Either an absolute bound (`min` / `max`), or a largest
    loss against a `baseline` variant (`max_loss`; "loss" follows the metric's direction: a drop for
    accuracy, a rise for perplexity; `relative` divides it by the baseline's value)."""

    variant: str = Field(..., min_length=1, description="variant name, or '*' for every variant except the baseline")
    task: str = Field(..., min_length=1, description="lm-eval task name, e.g. eightfold_heldout_ppl")
    metric: str = Field(..., min_length=1, description="metric name, e.g. word_perplexity, acc (with ',<filter>' "
                        "when the task's filter is not 'none', e.g. exact_match,strict-match)")
    min: float | None = None
    max: float | None = None
    baseline: str | None = Field(None, description="variant the loss is measured against")
    max_loss: float | None = Field(None, ge=0)
    relative: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> "GateConfig":
        absolute = self.min is not None or self.max is not None
        versus = self.baseline is not None or self.max_loss is not None
        if absolute == versus:
            raise ValueError(
                f"gate on {self.variant}/{self.task}/{self.metric}: give either min/max, or baseline with max_loss"
            )
        if versus and (self.baseline is None or self.max_loss is None):
            raise ValueError(f"gate on {self.variant}/{self.task}/{self.metric}: baseline and max_loss go together")
        return self


class EvaluateConfig(Section):
    """The evaluate stage (seed: "Validate. Re-run evaluations on the converted, quantized model")."""

    tasks: list[str] = Field(
        default_factory=lambda: list(SUITE_TASKS),
        min_length=1,
        description=f"lm-eval task names: the offline suite ({', '.join(SUITE_TASKS)}) or any standard task whose data is reachable",
    )
    limit: int | None = Field(None, ge=1, description="at most this many examples per task (lm-eval's --limit)")
    variants: list[VariantConfig] = Field(
        default_factory=list,
        description="models to evaluate; empty: every Hugging Face folder in the inputs (hf/ and quantized/*/)",
    )
    backend: Literal["engine", "hf"] = Field(
        "engine", description="engine: the serving engine (stages/serve); hf: transformers (a cross-check)"
    )
    batch_size: int = Field(16, ge=1, description="requests handed to the backend at once")
    max_gen_toks: int = Field(24, ge=1, description="most tokens generated per generate_until request")
    max_length: int | None = Field(None, ge=8, description="context window in tokens (default: the model's, less 2)")
    unloadable: Literal["dequantize", "skip", "fail"] = Field(
        "dequantize",
        description="a quantized variant the engine cannot load itself (packed INT4, GGUF): dequantize its weights "
                    "with the export stage's reference reader and run them on the engine (noted in the table), list "
                    "it as skipped with the reason, or fail the stage",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("auto", description="auto (cuda when available, else cpu), cpu or cuda")
    kv_cache_memory_gb: float = Field(0.25, gt=0, description="engine KV cache budget")
    seed: int = Field(1234, description="seed of the verifiable task family's held-out examples")
    heldout_examples: int = Field(200, ge=1, description="held-out examples per verifiable task kind (at most)")
    arithmetic_max_operand: int | None = Field(
        None, ge=1, le=9999,
        description="None: multi-digit arithmetic; N: a OP b with operands 0..N, the small set post-train trains on",
    )
    arithmetic_ops: str = Field("+-*", pattern=r"^[+\-*]+$", description="operators of the arithmetic problems")
    apply_chat_template: bool = Field(
        False, description="render every prompt with the tokenizer's chat template (lm-eval's option; post-trained chat models)"
    )
    mc_choices: int = Field(4, ge=2, le=10, description="choices per multiple-choice question (one right)")
    ppl_max_docs: int = Field(40, ge=1, description="validation documents scored for held-out perplexity")
    ppl_max_chars: int = Field(3000, ge=100, description="each validation document is cut to this many characters")
    code_max_functions: int = Field(60, ge=1, description="held-out Python functions in the code-completion task")
    code_max_body_chars: int = Field(600, ge=20, description="longer function bodies are skipped")
    bootstrap_iters: int = Field(200, ge=0, description="lm-eval bootstrap iterations for stderr (0: off)")
    gates: list[GateConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _names(self) -> "EvaluateConfig":
        names = [v.name for v in self.variants]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"evaluate.variants: names must be unique, repeated: {dup}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError(f"evaluate.tasks lists a task twice: {self.tasks}")
        if self.variants:
            known = set(names) | {"*"}
            for g in self.gates:
                for n in (g.variant, g.baseline):
                    if n is not None and n not in known:
                        raise ValueError(f"evaluate.gates names variant {n!r}; evaluate.variants has {sorted(names)}")
        for g in self.gates:
            if g.task not in self.tasks:
                raise ValueError(f"evaluate.gates names task {g.task!r}, which evaluate.tasks does not run ({self.tasks})")
        return self
