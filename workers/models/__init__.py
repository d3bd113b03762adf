"""Our Llama-family model code (Llama, Qwen2, Mistral layouts) over a paged KV cache, and its loader for HF
checkpoint directories.

May import: torch, transformers (configs and tokenizers), safetensors and the standard library. Nothing of
workers.engine, workers.spec or any other part of the project: the engine drives these models.
"""
