"""The model: a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU or a mixture of
experts) written as plain modules that take a ModelConfig and nothing else. Parameter names follow
Hugging Face's Llama (`embed_tokens`, `layers.{i}.self_attn.q_proj`, ...), so export is a prefix, not
a rename. Parallelism is applied from outside (`trainer/parallel/`); the model never knows about it.
Its linear layers multiply bf16 as bf16 hardware does, also on CPUs that lack it (`bf16_matmul.py`)."""

from .moe import MoE
from .transformer import Attention, Block, MLP, RMSNorm, Transformer, param_counts

__all__ = ["Attention", "Block", "MLP", "MoE", "RMSNorm", "Transformer", "param_counts"]
