"""Hugging Face I/O: loading a causal LM and its tokenizer (local directories, GGUF, random init
from a config) and exporting one as a safetensors directory."""
