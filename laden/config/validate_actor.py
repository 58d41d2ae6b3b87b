"""Validation of the actor's training settings: micro-batches, fused kernels, LoRA and the optimizer.

Errors for settings that cannot work together (a micro-batch smaller than the longest sequence,
LoRA on tensor-parallel projections); a `UserWarning` for settings that are legal but ignored or
known to hurt (`adam` with bf16 optimizer storage, LoRA options without `actor.use_lora`).
"""

from __future__ import annotations

import warnings

from laden.config.schema import LadenConfig
from laden.config.validate_alloc import parse_or_none

__all__ = [
    "fused_errors", "longest_max_length", "lora_errors", "micro_batch_errors", "warn_lora", "warn_optimizer",
]  # fmt: skip


def longest_max_length(cfg: LadenConfig) -> int:
    """The larger `max_length` of `train_dataset` and `valid_dataset`: the longest sequence (a pair's longest
    side) the micro-batch budget must hold in `laden sft`, `laden dpo` and `laden rw`, whose evaluation packs
    the validation set under the training budget."""
    valid = cfg.valid_dataset
    return max(cfg.train_dataset.max_length, valid.max_length if valid is not None else 0)


def micro_batch_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    """A micro-batch must hold the longest sequence: for RL the prompt budget + max_new_tokens, else the longer
    max_length of the training and validation sets (`longest_max_length`)."""
    budget = cfg.actor.mb_spec.max_tokens_per_mb
    if budget is None:
        return []
    if rl:
        need = cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
        terms = "train_dataset.max_length + gconfig.max_new_tokens"
    else:
        need = longest_max_length(cfg)
        longer = "valid_dataset" if need > cfg.train_dataset.max_length else "train_dataset"
        terms = f"{longer}.max_length"
    if budget >= need:
        return []
    return [
        f"actor.mb_spec.max_tokens_per_mb={budget} is smaller than {terms} = {need}; "
        f"set it to at least {need}"
    ]


def fused_errors(cfg: LadenConfig) -> list[str]:
    if cfg.actor.fused_elementwise is True and not cfg.actor.lean_activations:
        return [
            "actor.fused_elementwise=true needs actor.lean_activations=true: the fused kernels are the "
            "lean RMSNorm's and gated MLP's math; set actor.lean_activations: true or drop fused_elementwise"
        ]
    return []


def lora_errors(cfg: LadenConfig) -> list[str]:
    """`actor.use_lora`: LoRA is the one method, on projections that are not tensor-parallel DTensors."""
    a = cfg.actor
    errors = []
    if a.peft_type != "lora":
        errors.append(
            f"actor.peft_type={a.peft_type!r}: only 'lora' is implemented (peft's LoRA adapters); set "
            "actor.peft_type: lora"
        )
    if any(not isinstance(m, str) or not m.strip() for m in a.target_modules):
        errors.append(
            f"actor.target_modules={a.target_modules!r} holds an empty name; list module names such as "
            "[q_proj, v_proj], or [] for every linear layer"
        )
    mode = parse_or_none(a.backend)
    if a.use_lora and mode is not None and mode.tp > 1:
        errors.append(
            f"actor.use_lora=true with actor.backend={a.backend!r}: tensor parallelism shards the plain linear "
            "projections that LoRA wraps; use t=1 (e.g. "
            f"{mode.backend}:d{mode.dp * mode.tp}" + (f"c{mode.cp}" if mode.cp > 1 else "") + "), or "
            "actor.use_lora: false"
        )
    return errors


def warn_lora(cfg: LadenConfig) -> None:
    a, default = cfg.actor, type(cfg.actor)()
    names = ("lora_rank", "lora_alpha", "target_modules")
    changed = [f for f in names if getattr(a, f) != getattr(default, f)]
    if changed and not a.use_lora:
        warnings.warn(
            f"actor.{{{', '.join(changed)}}} are ignored without actor.use_lora: true (the whole model trains); "
            "set actor.use_lora: true to train LoRA adapters, or remove them",
            UserWarning,
            stacklevel=3,
        )


def warn_optimizer(cfg: LadenConfig) -> None:
    opt_type, storage = cfg.actor.optimizer.type, cfg.actor.optimizer_dtype
    if opt_type == "adam" and storage == "bfloat16":
        warnings.warn(
            "actor.optimizer.type='adam' with actor.optimizer_dtype='bfloat16': torch AdamW silently "
            "keeps bf16 optimizer states, and the loss later ends up ~3x higher than with fp32 master "
            "weights; use actor.optimizer.type: adam_bf16 (Kahan summation) or "
            "actor.optimizer_dtype: float32",
            UserWarning,
            stacklevel=3,
        )
    elif opt_type == "adam_bf16" and storage == "float32":
        warnings.warn(
            "actor.optimizer_dtype='float32' is ignored with actor.optimizer.type='adam_bf16', which "
            "keeps bf16 master weights and states; set actor.optimizer_dtype: bfloat16 to say so, or "
            "use actor.optimizer.type: adam for fp32 states",
            UserWarning,
            stacklevel=3,
        )
