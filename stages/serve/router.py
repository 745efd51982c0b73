"""Several engine replicas behind one endpoint (seed, "operating it": a KV-cache-aware router and
canary roll-outs).

Prefix affinity: requests whose first blocks hash the same go to the same replica (rendezvous
hashing on the chained block hash), so that replica's prefix cache serves them; when the chosen
replica carries clearly more load than the least-loaded one, the request goes there instead.
Canary: a configured share of requests (or any request naming the canary model) goes to the canary
engine; every metric carries the model name, so the canary is compared with the primary on /metrics.
A replica is anything with AsyncEngine's `generate`, `load`, `model_name` and `engine`: a
`DisaggregatedEngine` (disagg.py, prefill and decode pools shipping K/V between them) is one too.
LoRA adapters (lora.py) are loaded into every primary replica and served as models of their own: a
request naming one goes to a replica as any other and runs there with the adapter (`AdapterRoute`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Sequence

from .async_engine import AsyncEngine
from .disagg import DisaggregatedEngine
from .kv_cache import prefix_block_hashes

Replica = AsyncEngine | DisaggregatedEngine


@dataclass
class RouterConfig:
    affinity_blocks: int = 1
    """Leading full blocks hashed for affinity (a shared system prompt is usually in the first)."""
    max_load_imbalance: int = 8
    """Leave the affine replica when it has this many more requests than the least loaded."""
    canary_share: float = 0.0
    """Fraction of requests sent to the canary (0..1)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.canary_share <= 1.0:
            raise ValueError(f"canary_share must be in [0, 1], got {self.canary_share}")


class Router:
    def __init__(self, replicas: Sequence[Replica], canary: Replica | None = None,
                 config: RouterConfig | None = None):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.canary = canary
        self.config = config or RouterConfig()
        if self.canary is None and self.config.canary_share > 0:
            raise ValueError("canary_share > 0 needs a canary engine")
        self._rng = random.Random(self.config.seed)
        self.routed: dict[str, int] = {}

    @property
    def primary(self) -> Replica:
        return self.replicas[0]

    @property
    def engines(self) -> list[Replica]:
        return self.replicas + ([self.canary] if self.canary else [])

    def model_names(self) -> list[str]:
        """The base model's, the canary's and every LoRA adapter's name."""
        names = []
        for e in self.engines:
            if e.model_name not in names:
                names.append(e.model_name)
        return names + self.lora_names()

    # -- LoRA adapters: the same set on every primary replica --------------------------------------
    def lora_names(self) -> list[str]:
        return list(self.primary.engine.loras)

    def lora_path(self, name: str) -> str:
        return self.primary.engine.loras[name].path

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Load an adapter into every primary replica (ValueError / FileNotFoundError as LLMEngine.load_lora)."""
        if any(isinstance(r, DisaggregatedEngine) for r in self.replicas):
            raise ValueError("LoRA adapters are not served with prefill/decode disaggregation")
        if name in self.model_names() and name not in self.lora_names():
            raise ValueError(f"{name!r} is the name of a served model, not available for a LoRA adapter")
        for r in self.replicas:
            r.engine.load_lora(name, path, replace=replace)

    def unload_lora(self, name: str) -> None:
        """LookupError when no adapter has that name."""
        for r in self.replicas:
            r.engine.unload_lora(name)

    def resolve_model(self, requested: str | None) -> str | None:
        """The model a request names must be served here (None/empty = the primary)."""
        if requested and requested not in self.model_names():
            raise LookupError(f"model {requested!r} is not served here; available: {self.model_names()}")
        return requested or None

    def choose(self, prompt_ids: Sequence[int], model: str | None = None) -> "Replica | AdapterRoute":
        if model is not None and model in self.primary.engine.loras:
            return AdapterRoute(self._affine(prompt_ids), model)
        if self.canary is not None and (model == self.canary.model_name and model != self.primary.model_name
                                        or (not model and self._rng.random() < self.config.canary_share)):
            chosen = self.canary
        else:
            chosen = self._affine(prompt_ids)
        key = f"{chosen.model_name}#{self.engines.index(chosen)}"
        self.routed[key] = self.routed.get(key, 0) + 1
        return chosen

    def _affine(self, prompt_ids: Sequence[int]) -> Replica:
        if len(self.replicas) == 1:
            return self.replicas[0]
        bs = self.primary.engine.config.block_size
        hashes = prefix_block_hashes(list(prompt_ids), bs, self.config.affinity_blocks)
        key = hashes[-1] if hashes else bytes(str(list(prompt_ids)), "utf-8")
        # rendezvous hashing: the replica with the highest hash(key, replica) wins
        scores = [hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=8).digest() for i in range(len(self.replicas))]
        best = max(range(len(self.replicas)), key=lambda i: scores[i])
        loads = [r.load for r in self.replicas]
        least = min(range(len(self.replicas)), key=lambda i: loads[i])
        if loads[best] - loads[least] >= self.config.max_load_imbalance:
            return self.replicas[least]
        return self.replicas[best]

    def start(self) -> "Router":
        for e in self.engines:
            e.start()
        return self

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()


class AdapterRoute:
    """A replica as a request naming one of its LoRA adapters sees it: `generate` runs with the adapter,
    and the served name is the adapter's (what vLLM's responses carry)."""

    def __init__(self, replica: AsyncEngine, lora_name: str):
        self.replica, self.model_name = replica, lora_name

    @property
    def engine(self):
        return self.replica.engine

    @property
    def load(self) -> int:
        return self.replica.load

    def generate(self, prompt_ids: Sequence[int], params, request_id: str | None = None):
        return self.replica.generate(prompt_ids, params, request_id, lora_name=self.model_name)
