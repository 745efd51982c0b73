"""The Hugging Face layout: what `transformers.AutoModelForCausalLM.from_pretrained(dir)`, vLLM and SGLang
load (seed: "Convert to the format your engine loads, usually safetensors in the Hugging Face layout").

Our parameter names are already Llama's, so a dense model is the `model.` prefix. The target
architecture follows the model:
  dense                      LlamaForCausalLM (Qwen3ForCausalLM when the model has QK-norm)
  MoE, every layer, no shared expert   MixtralForCausalLM, with Mixtral's on-disk names
                             (`block_sparse_moe.gate`, `experts.{e}.w1/w2/w3` = gate/down/up)
  MoE with a shared expert or dense layers in between   Qwen2MoeForCausalLM (`decoder_sparse_step`)
  MoE with QK-norm, no shared expert   Qwen3MoeForCausalLM
All of these route as we do at inference: softmax over the router logits, top-k, weights renormalised
over the k chosen, and no capacity limit (dropping is a training-time device).

Qwen2-MoE gates its shared expert by sigmoid(w . x); ours is always on. Writing w = 0 gives a gate of
exactly 1/2, so the shared expert's down projection is written doubled: 1/2 * 2 * y = y, exact in
floating point (scaling by 2 only moves the exponent).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from infra.config.model import ModelConfig

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class ExportError(ValueError):
    """The model cannot be written in the requested layout; the message says why."""


def hf_architecture(cfg: ModelConfig, moe_architecture: str = "auto") -> str:
    """model_type of the target architecture: llama, qwen3, mixtral, qwen2_moe or qwen3_moe."""
    moe = cfg.moe
    if moe is None:
        return "qwen3" if cfg.qk_norm else "llama"
    if cfg.qk_norm:
        if moe.shared_expert:
            raise ExportError("MoE with QK-norm and a shared expert has no Hugging Face architecture to map to "
                              "(Qwen3-MoE has no shared expert, Qwen2-MoE no QK-norm)")
        return "qwen3_moe"
    mixtral_ok = moe.every == 1 and not moe.shared_expert
    if moe_architecture == "mixtral":
        if not mixtral_ok:
            raise ExportError(f"Mixtral needs every layer MoE and no shared expert (moe.every={moe.every}, "
                              f"shared_expert={moe.shared_expert}); use moe_architecture=qwen2_moe")
        return "mixtral"
    if moe_architecture == "qwen2_moe":
        return "qwen2_moe"
    return "mixtral" if mixtral_ok else "qwen2_moe"


def hf_export_problem(cfg: ModelConfig, moe_architecture: str = "auto") -> str | None:
    """Why a model of this config, once trained, cannot be written as a Hugging Face checkpoint (which
    post-training's engine, export, evaluate and serve all load), or None: checked before anything runs."""
    try:
        hf_architecture(cfg, moe_architecture)
    except ExportError as e:
        return str(e)
    if cfg.moe is not None and cfg.moe.balance == "bias":
        return ("model.moe.balance=bias: the trained DeepSeek-V3 routing bias changes which experts are chosen, and "
                "no Hugging Face architecture this export writes (Mixtral, Qwen2-MoE, Qwen3-MoE) has one; use "
                "balance=aux_loss for a model that goes past pretraining")
    return None


ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
              "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    return cfg.moe is not None and i % cfg.moe.every == cfg.moe.every - 1


def to_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig, arch: str,
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our names -> the target architecture's on-disk names, cast to `dtype`. A tied LM head is not
    written (config.json's tie_word_embeddings ties it on load)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.startswith(MTP_PREFIX):  # multi-token prediction goes to the sidecar (write_mtp_sidecar)
            continue
        if name == "lm_head.weight":
            if not cfg.tie_embeddings:
                out[name] = t
            continue
        m = re.match(r"^layers\.(\d+)\.mlp\.(.+)$", name)
        if m is None or not is_moe_layer(cfg, int(m.group(1))):
            out["model." + name] = t
            continue
        layer, rest = m.group(1), m.group(2)
        if rest == "expert_bias":
            if torch.count_nonzero(t):
                raise ExportError(f"{name} is non-zero: the DeepSeek-V3 routing bias (moe.balance=bias) shifts which "
                                  f"experts are chosen, and {ARCH_CLASS[arch]} has no such bias; routing would differ")
            continue
        if arch == "mixtral":
            w = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
            rest = re.sub(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.",
                          lambda e: f"experts.{e.group(1)}.{w[e.group(2)]}.", rest)
            out[f"model.layers.{layer}.block_sparse_moe.{rest}"] = t
            continue
        if arch == "qwen2_moe" and rest == "shared_expert.down_proj.weight":
            t = t * 2  # see the module docstring: the zero gate gives 1/2
        out[f"model.layers.{layer}.mlp.{rest}"] = t
    if arch == "qwen2_moe":
        _qwen2_moe_fill(out, sd, cfg)
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in out.items()}


def _qwen2_moe_fill(out: dict[str, torch.Tensor], sd: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Qwen2-MoE always has a gated shared expert: a zero gate weight (see module docstring), and, when
    our model has no shared expert, an all-zero one (it then adds exactly 0)."""
    D = cfg.dim
    hidden = cfg.moe.ffn_dim or cfg.ffn_dim
    for i in range(cfg.n_layers):
        if not is_moe_layer(cfg, i):
            continue
        p = f"model.layers.{i}.mlp."
        out[p + "shared_expert_gate.weight"] = torch.zeros(1, D)
        if not cfg.moe.shared_expert:
            out[p + "shared_expert.gate_proj.weight"] = torch.zeros(hidden, D)
            out[p + "shared_expert.up_proj.weight"] = torch.zeros(hidden, D)
            out[p + "shared_expert.down_proj.weight"] = torch.zeros(D, hidden)


def from_hf_state_dict(hf: dict[str, torch.Tensor], cfg: ModelConfig, arch: str) -> dict[str, torch.Tensor]:
    """The inverse of `to_hf_state_dict` (used to check a written folder with our own model)."""
    out: dict[str, torch.Tensor] = {}
    w = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    for name, t in hf.items():
        if name.endswith("shared_expert_gate.weight"):
            continue
        key = name.removeprefix("model.")
        if arch == "mixtral":
            key = key.replace(".block_sparse_moe.", ".mlp.")
            key = re.sub(r"\.experts\.(\d+)\.(w1|w2|w3)\.", lambda e: f".experts.{e.group(1)}.{w[e.group(2)]}.", key)
        if arch == "qwen2_moe" and ".shared_expert." in key:
            if not cfg.moe.shared_expert:
                continue
            if key.endswith("shared_expert.down_proj.weight"):
                t = t / 2
        out[key] = t
    if cfg.tie_embeddings or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    if cfg.moe is not None:
        for i in range(cfg.n_layers):
            if is_moe_layer(cfg, i):
                out.setdefault(f"layers.{i}.mlp.expert_bias", torch.zeros(cfg.moe.num_experts))
    return out


def special_token_ids(tokenizer_dir: Path | None) -> dict[str, int | None]:
    """bos/eos/pad ids from the tokenizer artifact's tokenizer_config.json and tokenizer.json."""
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return ids
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    by_content = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    by_content.update({k: v for k, v in vocab.get("model", {}).get("vocab", {}).items() if k not in by_content})
    conf_path = tokenizer_dir / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
    for role in ("bos", "eos", "pad"):
        tok = conf.get(f"{role}_token")
        tok = tok["content"] if isinstance(tok, dict) else tok
        if tok is not None:
            ids[f"{role}_token_id"] = by_content.get(tok)
    return ids


def end_of_turn(tokenizer_dir: Path | None) -> tuple[str, int] | None:
    """(token, id) of the chat template's end-of-turn token, when the tokenizer artifact has a chat
    template that closes turns with a special token of its vocabulary (stages/tokenizer.py's `<|end|>`)."""
    from ..tokenizer import END_OF_TURN

    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    conf_path = tokenizer_dir / "tokenizer_config.json"
    template = json.loads(conf_path.read_text()).get("chat_template") if conf_path.is_file() else None
    if not isinstance(template, str) or END_OF_TURN not in template:
        return None
    added = {t["content"]: t["id"] for t in json.loads((tokenizer_dir / "tokenizer.json").read_text()).get("added_tokens", [])}
    return (END_OF_TURN, added[END_OF_TURN]) if END_OF_TURN in added else None


def hf_config(cfg: ModelConfig, arch: str, dtype: str, token_ids: dict[str, int | None]) -> dict[str, Any]:
    """config.json for the target architecture, mapping our ModelConfig field by field."""
    c: dict[str, Any] = {
        "architectures": [ARCH_CLASS[arch]],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers >= 5 reads rope_parameters; vLLM and older readers read rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
        **token_ids,
    }
    moe = cfg.moe
    if arch == "mixtral":
        c.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                 intermediate_size=moe.ffn_dim or cfg.ffn_dim, router_jitter_noise=0.0,
                 router_aux_loss_coef=moe.aux_loss_coef, output_router_logits=False, sliding_window=None)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        c.update(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                 moe_intermediate_size=moe.ffn_dim or cfg.ffn_dim, decoder_sparse_step=moe.every,
                 mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=moe.aux_loss_coef,
                 output_router_logits=False, use_sliding_window=False, sliding_window=None)
        if arch == "qwen2_moe":
            c.update(qkv_bias=False, shared_expert_intermediate_size=moe.ffn_dim or cfg.ffn_dim)
    if arch in ("qwen3", "qwen3_moe"):
        c.update(use_sliding_window=False, sliding_window=None)
    return c


def model_config_from_hf(c: dict[str, Any]) -> tuple[ModelConfig, str]:
    """Our ModelConfig (and the architecture) back from a config.json this module wrote."""
    from infra.config.model import MoEConfig

    arch = c["model_type"]
    moe = None
    if arch == "mixtral":
        moe = MoEConfig(num_experts=c["num_local_experts"], top_k=c["num_experts_per_tok"],
                        ffn_dim=c["intermediate_size"], capacity_factor=None, balance="none")
    elif arch in ("qwen2_moe", "qwen3_moe"):
        shared = arch == "qwen2_moe" and c.get("shared_expert_intermediate_size", 0) > 0
        moe = MoEConfig(num_experts=c["num_experts"], top_k=c["num_experts_per_tok"], ffn_dim=c["moe_intermediate_size"],
                        every=c.get("decoder_sparse_step", 1), shared_expert=shared, capacity_factor=None, balance="none")
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
    mc = ModelConfig(vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
                     n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"], head_dim=c.get("head_dim"),
                     ffn_dim=c["intermediate_size"], max_seq_len=c["max_position_embeddings"], rope_theta=theta,
                     norm_eps=c["rms_norm_eps"], tie_embeddings=c.get("tie_word_embeddings", False),
                     qk_norm=arch in ("qwen3", "qwen3_moe"), moe=moe)
    return mc, arch


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int,
                      metadata: dict[str, str] | None = None) -> list[str]:
    """Sharded safetensors (`model-00001-of-0000N.safetensors`, tensors in name order, a new shard when
    the next tensor would pass `max_shard_bytes`) and `model.safetensors.index.json` mapping every tensor
    to its shard. Returns the shard file names."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors, key=_natural_key):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    weight_map: dict[str, str] = {}
    files = []
    for i, names in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names}, str(out_dir / fname), metadata={"format": "pt", **(metadata or {})})
        weight_map.update({k: fname for k in names})
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's shards, through the index when there is one."""
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(model_dir / f)))
    return out


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def copy_tokenizer(tokenizer_dir: Path | None, out_dir: Path) -> list[str]:
    """The tokenizer files beside the weights. A chat tokenizer's end-of-turn token becomes the
    shipped tokenizer's eos_token (as chat models ship, e.g. Qwen2.5-Instruct's `<|im_end|>`): what
    vLLM (`tokenizer.eos_token_id`), lm-eval and transformers' pipelines stop a chat turn on. The
    document EOS stays a stop token through generation_config.json."""
    if tokenizer_dir is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out_dir / name)
            copied.append(name)
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"tokenizer artifact {tokenizer_dir} has no tokenizer.json")
    eot = end_of_turn(tokenizer_dir)
    if eot is not None:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            path = out_dir / name
            if path.is_file():
                conf = json.loads(path.read_text())
                old = conf.get("eos_token")
                conf["eos_token"] = {**old, "content": eot[0]} if isinstance(old, dict) else eot[0]
                path.write_text(json.dumps(conf, indent=2))
    return copied


def generation_config(token_ids: dict[str, int | None], end_of_turn_id: int | None = None) -> dict[str, Any]:
    """Greedy by default: the export's checks and evaluation expect deterministic decoding. With a
    chat template's end-of-turn token, eos_token_id is the list [EOS, end of turn]: transformers'
    generate and vLLM stop on every id of it."""
    conf = {"do_sample": False, **{k: v for k, v in token_ids.items() if v is not None}}
    if end_of_turn_id is not None:
        eos = conf.get("eos_token_id")
        conf["eos_token_id"] = [i for i in (eos, end_of_turn_id) if i is not None]
    return conf


def write_generation_config(out_dir: Path, token_ids: dict[str, int | None], tokenizer_dir: Path | None) -> None:
    eot = end_of_turn(tokenizer_dir)
    conf = generation_config(token_ids, eot[1] if eot else None)
    (out_dir / "generation_config.json").write_text(json.dumps(conf, indent=2))


def write_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path, *, dtype: str = "bfloat16",
             tokenizer_dir: str | Path | None = None, max_shard_mb: float = 4900.0,
             moe_architecture: str = "auto") -> dict[str, Any]:
    """Write the Hugging Face folder: sharded safetensors + index, config.json, generation_config.json and
    the tokenizer files. Returns {"architecture", "files", "bytes"}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    arch = hf_architecture(cfg, moe_architecture)
    mtp = {k: v for k, v in sd.items() if k.startswith(MTP_PREFIX)}
    tensors = to_hf_state_dict({k: v for k, v in sd.items() if not k.startswith(MTP_PREFIX)}, cfg, arch, DTYPES[dtype])
    ids = special_token_ids(tok_dir)
    files = write_safetensors(tensors, out, int(max_shard_mb * 2**20))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, arch, dtype, ids), indent=2))
    write_generation_config(out, ids, tok_dir)
    copy_tokenizer(tok_dir, out)
    nbytes = sum((out / f).stat().st_size for f in files)
    result = {"architecture": ARCH_CLASS[arch], "model_type": arch, "files": files, "bytes": nbytes}
    if mtp:
        result["mtp_files"] = write_mtp_sidecar(mtp, cfg, out, DTYPES[dtype])
    return result


# Multi-token prediction (trainer/model/mtp.py) travels as a sidecar beside the Hugging Face folder, not in
# it: transformers' DeepSeek-V3 layout (the MTP module as `model.layers.{n_layers}`) belongs to the
# DeepseekV3 architecture (MLA, its MoE), which ours is not, and transformers skips that layer on load
# anyway; in a Llama/Qwen3/Mixtral folder the same names would be unexpected keys to transformers and
# to vLLM. The sidecar leaves the folder exactly what a model without MTP exports (model.safetensors.index.json
# lists only its own shards, so loaders never open the sidecar) and our engine reads it for `--speculative mtp`.
MTP_PREFIX = "mtp."
MTP_WEIGHTS, MTP_CONFIG = "mtp.safetensors", "mtp.json"


def write_mtp_sidecar(tensors: dict[str, torch.Tensor], cfg: ModelConfig, out: Path, dtype: torch.dtype) -> list[str]:
    """`mtp.safetensors`: the MTP modules' own weights under our names (`mtp.{k-1}.hnorm.weight`, ...,
    `mtp.{k-1}.block.<a decoder layer's names>`); the embedding and LM head they share are the main
    folder's. `mtp.json` says how to run them."""
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in sorted(tensors.items())},
              str(out / MTP_WEIGHTS), metadata={"format": "pt"})
    described = {
        "format": "eightfold-mtp", "version": 1, "depth": cfg.mtp_depth,
        "reference": "DeepSeek-V3 technical report, section 2.2 (sequential multi-token prediction)",
        "shares": ["model.embed_tokens.weight", "lm_head.weight" if not cfg.tie_embeddings else "model.embed_tokens.weight"],
        "module": ("depth k (1..depth) at position i: h_k = block(eh_proj(concat(hnorm(h_{k-1}), "
                   "enorm(embed(token[i+k]))))); logits for token[i+k+1] = lm_head(norm(h_k)); h_0 = the last decoder "
                   "layer's output before the model's final norm; block = one decoder layer of config.json's "
                   "architecture, its weights named as ours (layers.N without the model. prefix)"),
        "rms_norm_eps": cfg.norm_eps,
        "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
    }
    (out / MTP_CONFIG).write_text(json.dumps(described, indent=2))
    return [MTP_WEIGHTS, MTP_CONFIG]


def read_mtp_sidecar(model_dir: Path) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(depth, the MTP weights under our names) from a folder `write_hf` wrote, or None when it has none."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    if not (model_dir / MTP_CONFIG).is_file():
        return None
    described = json.loads((model_dir / MTP_CONFIG).read_text())
    if described.get("format") != "eightfold-mtp" or described.get("version") != 1:
        raise ValueError(f"{model_dir / MTP_CONFIG}: not an eightfold MTP sidecar of version 1 ({described.get('format')!r}, "
                         f"version {described.get('version')!r})")
    return int(described["depth"]), load_file(str(model_dir / MTP_WEIGHTS))


def write_reward_hf(trunk: dict[str, torch.Tensor], score: torch.Tensor, cfg: ModelConfig, out_dir: str | Path, *,
                    dtype: str = "bfloat16", tokenizer_dir: str | Path | None = None,
                    pad_token_id: int | None = None) -> dict[str, Any]:
    """A reward model (trainer/objectives/reward.py) as the architecture's sequence-classification class
    (LlamaForSequenceClassification, ...): the trunk's tensors without the LM head, `score.weight` [1, dim],
    num_labels 1. transformers reads the reward at each row's last non-pad token, so config.json needs a
    pad_token_id (the tokenizer's, else `pad_token_id`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    arch = hf_architecture(cfg)
    tensors = {k: v for k, v in to_hf_state_dict(trunk, cfg, arch, DTYPES[dtype]).items() if k != "lm_head.weight"}
    tensors["score.weight"] = score.detach().to("cpu", DTYPES[dtype]).reshape(1, cfg.dim).contiguous()
    ids = special_token_ids(tok_dir)
    if ids.get("pad_token_id") is None:
        ids["pad_token_id"] = pad_token_id
    if ids["pad_token_id"] is None:
        raise ExportError("a reward model's config needs a pad_token_id (the tokenizer has none): pass pad_token_id")
    files = write_safetensors(tensors, out, 4900 * 2**20)
    config = hf_config(cfg, arch, dtype, ids)
    config.update(architectures=[ARCH_CLASS[arch].replace("ForCausalLM", "ForSequenceClassification")], num_labels=1,
                  tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tok_dir, out)
    return {"architecture": config["architectures"][0], "files": files}
