"""The rules of the preference-pair jobs, `laden dpo` and `laden rw` (`laden.align`).

A pair's chosen and rejected sides share a micro-batch, so the token budget must hold two sides of
`max_length` (the training or the validation set's, the larger); the pair objectives sum over whole
documents, which a context-parallel slice is not; the reward model's score head is new, which LoRA
would leave frozen at zero.
"""

from __future__ import annotations

from laden.config.alloc import AllocationMode
from laden.config.schema import LadenConfig
from laden.config.validate_actor import longest_max_length

PAIR_JOBS = ("dpo", "rw")


def pair_job(cfg: LadenConfig, job: str) -> str | None:
    """The pair job `job` names (or, for `any`, the training data's type), else None."""
    kind = cfg.train_dataset.type if job == "any" else job
    return kind if kind in PAIR_JOBS else None


def pair_errors(cfg: LadenConfig, job: str) -> list[str]:
    """Every error of a `laden dpo` / `laden rw` config (none for other jobs)."""
    kind = pair_job(cfg, job)
    if kind is None:
        return []
    errors = []
    valid = cfg.valid_dataset
    if valid is not None and valid.type != kind:
        errors.append(
            f"valid_dataset.type={valid.type!r} but the job trains on {kind!r} pairs; set valid_dataset.type: {kind}"
        )
    budget, need = cfg.actor.mb_spec.max_tokens_per_mb, 2 * longest_max_length(cfg)
    if budget is not None and budget < need:
        name = "valid_dataset" if need > 2 * cfg.train_dataset.max_length else "train_dataset"
        errors.append(
            f"actor.mb_spec.max_tokens_per_mb={budget} cannot hold a pair of two {name}.max_length="
            f"{need // 2} sides (chosen and rejected share a micro-batch); set it to at least {need}"
        )
    try:
        context = AllocationMode.parse(cfg.actor.backend).cp
    except ValueError:
        context = 1  # reported by the allocation rules
    if context > 1:
        errors.append(
            f"actor.backend={cfg.actor.backend!r} splits sequences over {context} context-parallel ranks, and "
            f"`laden {kind}` sums each whole sequence (log-probs, or the score at its last token); use d, t or p "
            "instead of c"
        )
    if kind == "rw" and cfg.actor.use_lora:
        errors.append(
            "actor.use_lora=true with `laden rw`: the reward model's score head is new and LoRA would keep it frozen "
            "at zero; set actor.use_lora: false"
        )
    return errors
