"""From a training checkpoint to one full, unsharded state dict of the model (seed: "Merge the shards.
Concatenate tensor-parallel pieces along the dimension they were split on (columns for Q/K/V, gate and
up; rows for the output and down projections), stack the pipeline stages back into one list of layers,
and drop the optimizer state").

Two entry points:
  load_full_state_dict(checkpoint_dir)  a committed checkpoint folder: torch.distributed.checkpoint (DCP,
      `.metadata` + per-rank `*.distcp` files), or a plain `model.pt` / `model.safetensors`. DCP stores
      every tensor under its full (unsharded) name, so reading only the model's keys already merges TP,
      PP, EP and FSDP shards; optimizer state, loader position and RNG are never read.
  merge_shards(shards, cfg)  explicit per-rank state dicts (a tensor-parallel rank holds a slice of each
      matrix, a pipeline stage a subset of the layers, an expert-parallel rank a subset of the experts),
      for checkpoints written rank by rank without DCP and to test the rules above by hand.

Names are the trainer's (trainer/model/): `embed_tokens.weight`, `layers.{i}.self_attn.q_proj.weight`,
`layers.{i}.mlp.experts.{e}.down_proj.weight`, ..., `norm.weight`, `lm_head.weight`.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from infra.config.model import ModelConfig


class MergeError(ValueError):
    """The shards do not make one model: the message names the tensor and what is wrong."""


MODEL_KEY = re.compile(r"^(embed_tokens\.weight|norm\.weight|lm_head\.weight|layers\.\d+\..+|mtp\.\d+\..+)$")
# Wrappers that prefix parameter names: DDP (`module.`), torch.compile (`_orig_mod.`), activation
# checkpointing (`_checkpoint_wrapped_module.`), FSDP1 (`_fsdp_wrapped_module.`).
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
# Where a checkpoint nests the model's own state dict (`{"model": model.state_dict(), "optim": ...}`).
MODEL_SECTIONS = ("model.", "app.model.", "state.model.")

# Megatron's column/row pairs: column-parallel matrices are split along their outputs (dim 0 of an
# nn.Linear weight), row-parallel ones along their inputs (dim 1); the vocabulary is split by rows.
COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$")
ROW = re.compile(r"(o_proj|down_proj|eh_proj)\.weight$")  # eh_proj: MTP's projection (tensor_parallel.py)
VOCAB = re.compile(r"^(embed_tokens|lm_head)\.weight$")
EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts\.)(\d+)(\..+)$")
LAYER = re.compile(r"^layers\.(\d+)\.")


def canonical_name(key: str) -> str | None:
    """The model's own name for a checkpoint key, or None when it is not a model weight."""
    for section in MODEL_SECTIONS:
        if key.startswith(section) and MODEL_KEY.match(_strip_wrappers(key[len(section):])):
            return _strip_wrappers(key[len(section):])
    key = _strip_wrappers(key)
    return key if MODEL_KEY.match(key) else None


def _strip_wrappers(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key


def _full(t) -> torch.Tensor:
    """A plain CPU tensor from a tensor or DTensor (FSDP2 / TP plans): gathered, detached."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu")


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def model_weights(state: dict) -> dict[str, torch.Tensor]:
    """Only the model's tensors of a (possibly nested) checkpoint dict, under their canonical names;
    optimizer moments, step counters, loader and RNG state are dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in _flatten(state).items():
        name = canonical_name(key)
        if name is None or not isinstance(value, torch.Tensor):
            continue
        if name in out:
            raise MergeError(f"checkpoint holds {name!r} twice (keys collide after removing wrapper prefixes)")
        out[name] = _full(value)
    return out


def find_checkpoint(folder: str | Path) -> Path:
    """The checkpoint to export from a pretrain output folder: `result.json`'s `checkpoint` when set,
    else the folder itself if it is one, else the newest committed one under `checkpoints/` (a step
    folder with a manifest.json, or DCP's `.metadata`, or a model file), by the step number in its name."""
    folder = Path(folder)
    result = folder / "result.json"
    if result.is_file():
        ref = json.loads(result.read_text()).get("checkpoint")
        if ref:
            # The job wrote into its own output (a staging folder or a remote URI); this folder is the
            # committed copy of that output, so the same checkpoints/... path inside it comes first.
            inside = folder / ("checkpoints/" + ref.split("/checkpoints/", 1)[1]) if "/checkpoints/" in ref else None
            path = Path(ref.removeprefix("file://"))
            path = path if path.is_absolute() else folder / path
            for candidate in (inside, path):
                if candidate is not None and candidate.exists():
                    return candidate
            raise FileNotFoundError(f"{result} names checkpoint {ref}, which does not exist")
    if _is_checkpoint(folder):
        return folder
    root = folder / "checkpoints"
    candidates = [p for p in root.iterdir() if p.is_dir() and _is_checkpoint(p)] if root.is_dir() else []
    committed = [p for p in candidates if (p / "manifest.json").exists()] or candidates
    if not committed:
        raise FileNotFoundError(
            f"no checkpoint in {folder}: expected result.json with `checkpoint`, a DCP folder (.metadata), "
            f"model.pt / model.safetensors, or committed step folders under {root}"
        )

    def step(p: Path) -> int:
        digits = re.findall(r"\d+", p.name)
        return int(digits[-1]) if digits else -1

    return max(committed, key=step)


def _is_checkpoint(p: Path) -> bool:
    return (p / ".metadata").is_file() or (p / "model.pt").is_file() or (p / "model.safetensors").is_file()


def load_full_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full model state dict of one checkpoint folder, on CPU, whatever mesh it was saved on."""
    path = Path(checkpoint_dir)
    if (path / ".metadata").is_file():
        return _load_dcp(path)
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return model_weights(load_file(str(path / "model.safetensors")))
    if (path / "model.pt").is_file():
        return model_weights(torch.load(path / "model.pt", map_location="cpu", weights_only=True))
    raise FileNotFoundError(f"{path} is not a checkpoint: no .metadata (DCP), model.safetensors or model.pt")


def _load_dcp(path: Path) -> dict[str, torch.Tensor]:
    """Read only the model's tensors of a DCP checkpoint: no process group needed, and the optimizer's
    moments (twice the model's size in fp32) are never read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from trainer.safe_load import MetadataReader

    meta = MetadataReader(path).read_metadata()  # DCP's .metadata unpickled with an allowlist (safe_load)
    keys = {k for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and canonical_name(k) is not None}
    if not keys:
        raise MergeError(f"DCP checkpoint {path} holds no model tensors (keys: {sorted(meta.state_dict_metadata)[:8]})")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        loaded = _load_state_dict_from_keys(keys, storage_reader=MetadataReader(path))  # tensors only
    return model_weights(loaded)


# -- explicit per-rank shards -------------------------------------------------------------------


@dataclass
class RankShard:
    """The model state dict one rank saved, and where that rank sat in the mesh."""

    state_dict: dict[str, torch.Tensor]
    tp: int = 0
    pp: int = 0
    ep: int = 0


def tp_split_dim(name: str) -> int | None:
    """Dimension a tensor-parallel plan splits this tensor on; None = replicated on every TP rank."""
    if VOCAB.match(name) or COLUMN.search(name):
        return 0
    if ROW.search(name):
        return 1
    return None


def merge_tp(shards: list[dict[str, torch.Tensor]], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Join the TP ranks' pieces (in rank order). K/V with fewer KV heads than ranks were replicated
    (tp / n_kv_heads consecutive ranks hold the same head): one copy of each group is kept."""
    tp = len(shards)
    if tp == 1:
        return dict(shards[0])
    names = list(shards[0])
    for r, sd in enumerate(shards[1:], 1):
        if set(sd) != set(names):
            diff = sorted(set(sd) ^ set(names))[:5]
            raise MergeError(f"TP rank {r} holds different tensors than rank 0: {diff}")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        pieces = [_full(sd[name]) for sd in shards]
        dim = tp_split_dim(name)
        if dim is None:
            _check_replicas(name, pieces, "TP")
            out[name] = pieces[0]
            continue
        if re.search(r"self_attn\.(k_proj|v_proj)\.weight$", name) and cfg.kv_heads < tp:
            group = tp // cfg.kv_heads  # ranks sharing one KV head
            for g in range(cfg.kv_heads):
                _check_replicas(name, pieces[g * group:(g + 1) * group], "TP (replicated KV head)")
            pieces = pieces[::group]
        out[name] = torch.cat(pieces, dim=dim)
    return out


def merge_ep(shards: list[dict[str, torch.Tensor]], num_experts: int) -> dict[str, torch.Tensor]:
    """Gather experts from the EP ranks (in rank order). Ranks may name experts globally (rank r holds
    `experts.{r*E/ep + j}`, disjoint sets) or locally (every rank holds `experts.0..E/ep-1`): local
    names are renumbered. Everything else (attention, router, norms) is replicated across EP ranks."""
    ep = len(shards)
    if ep == 1:
        return dict(shards[0])
    if num_experts % ep:
        raise MergeError(f"{num_experts} experts do not split over {ep} expert-parallel ranks")
    per_rank = num_experts // ep
    expert_sets = [{m.group(1) + m.group(2) for k in sd if (m := EXPERT.match(k))} for sd in shards]
    local = all(s == expert_sets[0] for s in expert_sets) and bool(expert_sets[0])
    out: dict[str, torch.Tensor] = {}
    for r, sd in enumerate(shards):
        for name, t in sd.items():
            m = EXPERT.match(name)
            if m is None:
                if name in out:
                    _check_replicas(name, [out[name], _full(t)], "EP")
                else:
                    out[name] = _full(t)
                continue
            e = int(m.group(2))
            if local:
                if e >= per_rank:
                    raise MergeError(f"EP rank {r}: local expert index {e} in {name!r} exceeds {per_rank} per rank")
                e = r * per_rank + e
            new = f"{m.group(1)}{e}{m.group(3)}"
            if new in out:
                raise MergeError(f"expert tensor {new!r} is held by two EP ranks")
            out[new] = _full(t)
    return out


def merge_pp(stages: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack pipeline stages back into one list of layers. The model keeps global layer indices on
    every stage (`layers` is keyed by index), so this is a union; a layer on two stages is an error
    (a tied embedding / LM head present on both ends must be equal)."""
    out: dict[str, torch.Tensor] = {}
    owner: dict[str, int] = {}
    for s, sd in enumerate(stages):
        for name, t in sd.items():
            if name in out:
                if LAYER.match(name):
                    raise MergeError(f"{name!r} is held by pipeline stages {owner[name]} and {s}")
                _check_replicas(name, [out[name], _full(t)], "PP")
                continue
            out[name], owner[name] = _full(t), s
    return out


def merge_shards(shards: list[RankShard], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-rank state dicts from any TP x PP x EP layout (one data-parallel replica) -> the full state dict:
    TP pieces joined within each (stage, EP rank), experts gathered within each stage, stages stacked."""
    coords = [(s.pp, s.ep, s.tp) for s in shards]
    if len(set(coords)) != len(coords):
        raise MergeError("two shards claim the same (pp, ep, tp) position; pass one data-parallel replica")
    pps = sorted({s.pp for s in shards})
    stages = []
    for pp in pps:
        eps = sorted({s.ep for s in shards if s.pp == pp})
        per_ep = []
        for ep in eps:
            ranks = sorted((s for s in shards if s.pp == pp and s.ep == ep), key=lambda s: s.tp)
            if [s.tp for s in ranks] != list(range(len(ranks))):
                raise MergeError(f"stage {pp}, EP rank {ep}: TP ranks {[s.tp for s in ranks]} are not 0..n-1")
            per_ep.append(merge_tp([s.state_dict for s in ranks], cfg))
        num_experts = cfg.moe.num_experts if cfg.moe is not None else 1
        stages.append(merge_ep(per_ep, num_experts) if len(per_ep) > 1 else per_ep[0])
    full = merge_pp(stages)
    return complete_state_dict(full, cfg)


def _check_replicas(name: str, pieces: list[torch.Tensor], what: str) -> None:
    for i, p in enumerate(pieces[1:], 1):
        if p.shape != pieces[0].shape or not torch.equal(p, pieces[0]):
            raise MergeError(f"{name!r} should be replicated across {what} ranks but copy {i} differs from copy 0")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's state dict and its shape, built on the meta device (nothing allocated)."""
    from trainer.model import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def complete_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Check a merged state dict against the model (every tensor present, right shape, nothing extra);
    a tied LM head missing from the checkpoint is filled from the embedding."""
    want = expected_shapes(cfg)
    sd = dict(sd)
    if cfg.tie_embeddings and "lm_head.weight" not in sd and "embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["embed_tokens.weight"]
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want))
    if missing or extra:
        raise MergeError(f"merged state dict does not match the model: missing {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}, unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}")
    for name, shape in want.items():
        if tuple(sd[name].shape) != shape:
            raise MergeError(f"{name!r} has shape {tuple(sd[name].shape)} after merging, the model expects {shape}")
    return sd
