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

_HOST_OOM_TEXT = ("defaultcpuallocator: can't allocate memory", "cannot allocate memory", "std::bad_alloc")


def is_host_oom(exc: BaseException) -> bool:
    """A host allocation failure: Python's MemoryError or torch's CPU allocator refusing."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(t in text for t in _HOST_OOM_TEXT)


def is_oom(exc: BaseException) -> bool:
    """True for a device or host allocation failure."""
    if isinstance(exc, torch.OutOfMemoryError) or is_host_oom(exc):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def release_cached_memory() -> None:
    """Drop what the failed attempt left behind before retrying."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def host_oom_advice(cfg: LadenConfig) -> list[str]:
    """Knob changes for a host-memory OOM in training (the second guide's CPU OOM section), with values."""
    actor, advice = cfg.actor, []
    if actor.backend.startswith("roundpipe"):
        if actor.roundpipe.pin_model == "alloc":
            advice.append(
                "actor.roundpipe.pin_model=register (about 1x the model in pinned host memory instead of 1.5x)"
            )
        elif actor.roundpipe.pin_model == "register":
            advice.append("actor.roundpipe.pin_model=off (weights paged in on demand)")
        advice.append(
            "fewer micro-batches per step (actor.mb_spec.max_tokens_per_mb larger, or actor.roundpipe.num_microbatch "
            "smaller): each micro-batch's stage activations are parked in host memory"
        )
        if actor.roundpipe.optim_step == "async":
            advice.append("actor.roundpipe.optim_step=sync (no second upload buffer and gradient inbox)")
    if actor.fsdp.offload_params:
        advice.append(
            "actor.fsdp.offload_params=false (parameters, gradients and optimizer states back on the GPU)"
        )
    if actor.optimizer.type == "adam":
        advice.append(
            "actor.optimizer.type=adam_bf16 with actor.optimizer_dtype=bfloat16 (bf16 master weights and states)"
        )
    if actor.fsdp.memory_efficient_load:
        advice.append(
            "actor.fsdp.memory_efficient_load=false (rank 0 no longer holds the whole model at load)"
        )
    return advice


def training_oom_advice(cfg: LadenConfig, *, tokens_per_mb: int, longest_seq: int) -> list[str]:
    """Knob changes for a training-phase GPU OOM, cheapest first, with values and what each costs in speed."""
    actor = cfg.actor
    advice = []
    smaller = max(longest_seq, tokens_per_mb // 2)
    if smaller < tokens_per_mb:
        advice.append(
            f"actor.mb_spec.max_tokens_per_mb={smaller} (now {tokens_per_mb}; the longest sequence of this "
            f"step has {longest_seq} tokens; costs little while micro-batches stay long: halving 32K to 16K tokens cost "
            "2.4% on a Qwen3-1.7B shape), or oom_policy=auto to re-split failing steps automatically"
        )
    if not actor.gradient_checkpointing:
        advice.append(
            "actor.gradient_checkpointing=true (recompute activations in backward; costs about a third more compute)"
        )
    if not actor.chunked_loss:
        advice.append("actor.chunked_loss=true (never materialise the [tokens, vocab] logits; no slower)")
    if actor.optimizer.type == "adam":
        advice.append(
            "actor.optimizer.type=adam_bf16 with actor.optimizer_dtype=bfloat16 (8 instead of 16 bytes per parameter; "
            "as fast, bf16 masters with Kahan compensation)"
        )
    if cfg.actor.backend.startswith("fsdp") and not actor.fsdp.offload_params:
        advice.append(
            "actor.fsdp.offload_params=true, or actor.backend=roundpipe:d1 (model state in host memory; the slowest "
            "fix: weights and gradients cross PCIe every step and the optimizer runs on the host)"
        )
    return advice


class TrainingOOMError(RuntimeError):
    """A training step ran out of memory; the message lists the knob changes that fix it."""

    def __init__(
        self,
        cfg: LadenConfig,
        *,
        step: int,
        tokens_per_mb: int,
        longest_seq: int,
        cause: BaseException,
        in_collectives: bool = False,
    ):
        host = is_host_oom(cause)
        self.where = "host" if host else "GPU"
        lines = host_oom_advice(cfg) if host else []
        lines += training_oom_advice(cfg, tokens_per_mb=tokens_per_mb, longest_seq=longest_seq)
        note = ""
        if in_collectives:
            note = (
                "It happened inside the step's collectives, where the other ranks cannot retry with this one; "
                "the run stops here and a rerun of the same command resumes from the newest checkpoint.\n"
            )
        super().__init__(
            f"training step {step} ran out of {self.where} memory ({str(cause).splitlines()[0][:200]}).\n"
            + note
            + "Change one of, most effective first:\n"
            + "\n".join(f"  - {line}" for line in lines)
        )


class PhaseOOMError(RuntimeError):
    """Generation or a weight update of `laden rl` ran out of memory: the phase, the step, and the
    knob changes for this run (`laden.memory.doctor.phase_fixes`). The run stops; nothing is lost
    (a rerun resumes from the newest checkpoint). Raised for a weight update only when `oom_policy:
    auto` could not make it again through disk (`laden.rl.trainer._Run._push_weights`)."""

    def __init__(self, cfg: LadenConfig, *, phase: str, step: int, cause: BaseException) -> None:
        from laden.memory.doctor import phase_fixes

        host = is_host_oom(cause)
        self.phase, self.where = phase, "host" if host else "GPU"
        fixes = phase_fixes(cfg, phase, host=host)
        super().__init__(
            f"{phase} for step {step} ran out of {self.where} memory ({str(cause).splitlines()[0][:200]}). "
            "The run stops here; a rerun of the same command resumes from the newest checkpoint.\n"
            + "Change one of, most effective first:\n"
            + "\n".join(f"  - {line}" for line in fixes)
        )
