"""What each lifecycle stage does, Prefect-free: plain functions from input artifacts to an output
folder (data, tokenizer, ablations, pretrain, posttrain, export, evaluate, serve)."""
