"""The offline task suite, written at stage run time: the data files (task family held-out examples,
validation documents, held-out Python functions) in `data/`, the YAML tasks of `tasks/` and their
`utils.py`. Each YAML loads its data file with `custom_dataset: !function utils.load_jsonl`, which reads
`data/` beside `utils.py` (lm-eval imports it from the YAML's folder), so the folder works wherever it is
copied: `lm_eval --include_path <suite> ...` from any directory (a relative `data_files` would be
resolved against the current directory, an absolute one would name the build's staging folder).
`task_manager(suite_dir)` then loads them without indexing lm-eval's ~14,700 built-in tasks."""

from __future__ import annotations

import ast
import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator

from infra.config.evaluate import SUITE_TASKS, EvaluateConfig

from .task_family import make_split, multiple_choice, small_arithmetic

TEMPLATES = Path(__file__).parent / "tasks"


class EvaluationDataError(ValueError):
    """An input needed by the suite is missing or yields nothing usable; the message says which."""


# -- held-out text -------------------------------------------------------------------------------

def validation_texts(inputs: dict[str, Path], tokenizer=None) -> Iterator[str]:
    """Validation documents: from the cleaned-data artifact (`data`: validation/*.parquet), else decoded
    from the packed `tokens` artifact (val/ shards, documents split at their recorded offsets)."""
    if "data" in inputs:
        from stages.data.pipeline import iter_split_texts

        yield from iter_split_texts(Path(inputs["data"]), "validation")
        return
    if "tokens" in inputs:
        if tokenizer is None:
            raise EvaluationDataError("decoding the packed validation tokens needs the model's tokenizer")
        yield from _decode_packed(Path(inputs["tokens"]) / "val", tokenizer)
        return
    raise EvaluationDataError(f"the evaluate stage needs a 'data' or 'tokens' input for held-out text; got {sorted(inputs)}")


def _decode_packed(split_dir: Path, tokenizer) -> Iterator[str]:
    import numpy as np

    index_file = split_dir / "index.json"
    if not index_file.exists():
        raise EvaluationDataError(f"{split_dir}: no index.json; is it a packed token split?")
    index = json.loads(index_file.read_text())
    eos = index.get("eos_id")
    for shard in index["shards"]:
        tokens = np.load(split_dir / shard["file"], mmap_mode="r").reshape(-1)
        starts = list(np.load(split_dir / shard["docs"]).tolist()) + [len(tokens)]
        for a, b in zip(starts[:-1], starts[1:]):
            ids = [int(t) for t in tokens[a:b] if int(t) != eos]
            if ids:
                yield tokenizer.decode(ids)


def _cut_at_line(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n", 0, max_chars)
    return text[: cut + 1] if cut > 0 else text[:max_chars]


def perplexity_docs(texts: Iterable[str], max_docs: int, max_chars: int) -> list[dict]:
    docs = []
    for text in texts:
        text = _cut_at_line(text, max_chars)
        if text.strip():
            docs.append({"text": text})
        if len(docs) >= max_docs:
            break
    return docs


# -- held-out Python functions -------------------------------------------------------------------

def python_functions(texts: Iterable[str], max_functions: int, max_body_chars: int,
                     max_prompt_chars: int = 1500, fits: Callable[[str, str], bool] | None = None) -> list[dict]:
    """Functions with a docstring and a body after it, from Python source documents: prompt = the
    `def` line(s) through the docstring, body = the rest, both dedented to the `def`'s indentation.
    `fits(prompt, body)` can drop functions too long for the model's window (in tokens)."""
    out: list[dict] = []
    for doc_no, text in enumerate(texts):
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        lines = text.splitlines(keepends=True)
        nodes = sorted((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
                       key=lambda n: n.lineno)
        for node in nodes:
            first = node.body[0]
            if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)) or len(node.body) < 2:
                continue
            indent = lines[node.lineno - 1][: len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]

            def dedent(chunk: list[str]) -> str:
                return "".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in chunk)

            prompt = dedent(lines[node.lineno - 1: first.end_lineno])
            body = dedent(lines[first.end_lineno: node.end_lineno])
            if not body.strip() or len(body) > max_body_chars or len(prompt) > max_prompt_chars:
                continue
            if not body.endswith("\n"):
                body += "\n"
            if fits is not None and not fits(prompt, body):
                continue
            out.append({"prompt": prompt, "body": body, "name": node.name, "doc": doc_no})
            if len(out) >= max_functions:
                return out
    return out


# -- writing the suite ---------------------------------------------------------------------------

def family_rows(cfg: EvaluateConfig) -> dict[str, list[dict]]:
    """The task family's held-out examples as the suite's rows."""
    if cfg.arithmetic_max_operand is None:
        arith = make_split("arithmetic", "heldout", cfg.heldout_examples, cfg.seed)
    else:  # the small set: all of its held-out problems, up to heldout_examples
        available = len(small_arithmetic("heldout", cfg.arithmetic_max_operand, cfg.arithmetic_ops))
        arith = make_split("arithmetic", "heldout", min(cfg.heldout_examples, available), cfg.seed,
                           max_operand=cfg.arithmetic_max_operand, ops=cfg.arithmetic_ops)
    pyexpr = make_split("python_expr", "heldout", cfg.heldout_examples, cfg.seed)
    mc = []
    for e in arith:
        choices, gold = multiple_choice(e, cfg.mc_choices, cfg.seed)
        mc.append({"id": e.id, "prompt": e.prompt, "choices": choices, "gold": gold, "answer": e.answer})
    return {"arithmetic": [e.to_dict() for e in arith], "python_expr": [e.to_dict() for e in pyexpr],
            "arithmetic_mc": mc}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def write_suite(out_dir: Path, cfg: EvaluateConfig, texts: Iterable[str] | None,
                fits: Callable[[str, str], bool] | None = None) -> tuple[Path, dict[str, int]]:
    """Write data/ and the YAML tasks into `out_dir`; returns the folder and the examples per file.
    `texts` (validation documents) may be None when no task of the suite needs them; `fits` keeps
    code-completion examples within the model's window."""
    out_dir = Path(out_dir).resolve()
    data = out_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    for name, rows in family_rows(cfg).items():
        _write_jsonl(data / f"{name}.jsonl", rows)
        counts[name] = len(rows)
    needs_text = {"eightfold_heldout_ppl", "eightfold_code_completion"} & set(cfg.tasks)
    if needs_text:
        if texts is None:
            raise EvaluationDataError(f"tasks {sorted(needs_text)} need validation text (a 'data' or 'tokens' input)")
        texts = list(texts)
        ppl = perplexity_docs(texts, cfg.ppl_max_docs, cfg.ppl_max_chars)
        funcs = python_functions(texts, cfg.code_max_functions, cfg.code_max_body_chars, fits=fits)
        for task, rows, what in (("eightfold_heldout_ppl", ppl, "non-empty validation documents"),
                                 ("eightfold_code_completion", funcs, "Python functions with a docstring and a body")):
            if task in cfg.tasks and not rows:
                raise EvaluationDataError(f"task {task}: the validation split has no {what} ({len(texts)} documents)")
        _write_jsonl(data / "heldout_ppl.jsonl", ppl)
        _write_jsonl(data / "code_completion.jsonl", funcs)
        counts["heldout_ppl"], counts["code_completion"] = len(ppl), len(funcs)
    shutil.copy(TEMPLATES / "utils.py", out_dir / "utils.py")
    for task in SUITE_TASKS:
        if task not in cfg.tasks:
            continue
        text = (TEMPLATES / f"{task}.yaml").read_text()
        text = text.replace("__MAX_GEN_TOKS__", str(cfg.max_gen_toks))
        (out_dir / f"{task}.yaml").write_text(text)
    return out_dir, counts


class _QuietCustomDataset(logging.Filter):
    """Drops lm-eval's warning that a task with a `custom_dataset` takes `--metadata` kwargs, for the
    suite's own tasks only (they load their data file that way; there is nothing to pass)."""

    PREFIXES = tuple(f"{task}: Custom kwargs can be passed to `--metadata`" for task in SUITE_TASKS)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.PREFIXES))


def quiet_custom_dataset_warning() -> None:
    """Install `_QuietCustomDataset` on the logger of lm-eval's task loading, once."""
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _QuietCustomDataset) for f in logger.filters):
        logger.addFilter(_QuietCustomDataset())


def task_manager(suite_dir: Path, tasks: list[str]):
    """lm-eval's TaskManager over the suite; lm-eval's own tasks are indexed only when a requested
    name is not in the suite (that costs ~12 s)."""
    from lm_eval.tasks import TaskManager

    quiet_custom_dataset_warning()
    defaults = any(t not in SUITE_TASKS for t in tasks)
    tm = TaskManager(include_path=str(suite_dir), include_defaults=defaults)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        raise EvaluationDataError(f"unknown lm-eval task(s) {unknown}" + ("" if defaults else f"; the suite has {list(SUITE_TASKS)}"))
    return tm


def token_window_filter(tokenizer, max_length: int) -> Callable[[str, str], bool]:
    """Keep a code example when its body fits one scoring window with at least a few prompt tokens
    (lm-eval truncates the prompt on the left, never the body)."""
    def fits(prompt: str, body: str) -> bool:
        return len(tokenizer.encode(body)) + 8 <= max_length
    return fits
