"""What every benchmark script records the same way: the model shapes it names and the commit it ran.

Standard library only: `roundpipe_ref.py` imports it in a process that must not load laden or
transformers 5.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

# Qwen3 shapes, random init (BENCHMARKS.md's reference workloads).
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip


def shapes(*names: str, **extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The named Qwen3 shapes plus script-specific ones (e.g. a CPU smoke `tiny`)."""
    return {**{name: QWEN3_SHAPES[name] for name in names}, **extra}


def git_commit() -> str:
    """HEAD of the checkout the script runs from (`-dirty` with local changes), or $GIT_COMMIT."""
    try:
        root = Path(__file__).resolve().parent.parent
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GIT_COMMIT", "unknown")
