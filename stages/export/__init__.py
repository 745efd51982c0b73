"""The export stage (seed, export chapter: merge, convert, quantize, validate). merge.py rebuilds one full
state dict from a checkpoint saved on any mesh; hf.py writes it in the Hugging Face layout (Llama, Qwen3,
Mixtral, Qwen2-MoE); quantize.py writes FP8 / INT8 / INT4 in compressed-tensors layouts and holds the
reference dequantizer, awq.py the activation-aware scaling before INT4; gguf_export.py writes GGUF for
llama.cpp; validate.py re-runs a fixed check on every variant against the unquantized model; sizes.py
counts bytes per variant; registry.py registers every exported folder as an MLflow model
version and resolves models:/NAME@ALIAS; peft_adapter.py checks a post-train LoRA
adapter against the base and merged weights and writes it in PEFT's layout; stage.py wires these into `run(ctx)`."""
