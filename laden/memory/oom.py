"""Out-of-memory classification and the knob change that fixes it.

The OOM guides laden is built from tell a person, after the crash, which knob to turn.
Here the same advice is produced with concrete values from the running config, and with
`oom_policy: auto` the training step is re-split into smaller micro-batches and retried:
the step's samples stay the same, so no sample is dropped and the result equals a run that
used the smaller budget from the start.
"""

from __future__ import annotations

import gc

import torch

from laden.config import LadenConfig


def is_oom(exc: BaseException) -> bool:
    """True for a device or host allocation failure."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def release_cached_memory() -> None:
    """Drop what the failed attempt left behind before retrying."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def training_oom_advice(cfg: LadenConfig, *, tokens_per_mb: int, longest_seq: int) -> list[str]:
    """Knob changes for a training-phase OOM, most effective first, with values."""
    actor = cfg.actor
    advice = []
    smaller = max(longest_seq, tokens_per_mb // 2)
    if smaller < tokens_per_mb:
        advice.append(
            f"actor.mb_spec.max_tokens_per_mb={smaller} (now {tokens_per_mb}; the longest sequence of this "
            f"step has {longest_seq} tokens), or oom_policy=auto to re-split failing steps automatically"
        )
    if not actor.gradient_checkpointing:
        advice.append("actor.gradient_checkpointing=true (recompute activations in backward)")
    if not actor.chunked_loss:
        advice.append("actor.chunked_loss=true (never materialise the [tokens, vocab] logits)")
    if actor.optimizer.type == "adam":
        advice.append(
            "actor.optimizer.type=adam_bf16 with actor.optimizer_dtype=bfloat16 (8 instead of 16 bytes per parameter)"
        )
    if cfg.actor.backend.startswith("fsdp") and not actor.fsdp.offload_params:
        advice.append(
            "actor.fsdp.offload_params=true, or actor.backend=roundpipe:d1 (model state in host memory)"
        )
    return advice


class TrainingOOMError(RuntimeError):
    """A training step ran out of memory; the message lists the knob changes that fix it."""

    def __init__(
        self, cfg: LadenConfig, *, step: int, tokens_per_mb: int, longest_seq: int, cause: BaseException
    ):
        lines = training_oom_advice(cfg, tokens_per_mb=tokens_per_mb, longest_seq=longest_seq)
        where = "GPU" if isinstance(cause, torch.OutOfMemoryError) else "host"
        super().__init__(
            f"training step {step} ran out of {where} memory ({str(cause).splitlines()[0][:200]}).\n"
            "Change one of, most effective first:\n" + "\n".join(f"  - {line}" for line in lines)
        )
