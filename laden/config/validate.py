"""Cross-field rules of the configuration, checked at load time, all errors collected.

Each rule returns error lines of the form `<dotted.field>=<value> <why>; <fix>`, so the
loader can report every problem at once. Rules that need the model (attention heads)
live in `validate_against_model`; `validate_config` applies them to the `config.json` at
`actor.path` (read as JSON, no weights, no torch), so `laden config show` and every rank
of a job report a head split that does not divide before anything is loaded. Settings
that are legal but ignored or known to hurt (e.g. `adam` with bf16 optimizer storage)
give a `UserWarning` instead of an error. Trade-off: ranges are a flat table rather than
per-dataclass `__post_init__` checks, so a config object may be built with bad values
(tests and the loader need that) and is only judged here; and validation reads the disk
(`actor.path`/config.json, the nearest existing ancestor of `cluster.fileroot`) but never
writes to it, so a config naming a model that is not downloaded yet does not validate.

This module holds `validate_config`, the range table and the rules on names, the job and the
file system; the rules of each section live beside it: `validate_alloc` (parallel layouts and
GPU counts), `validate_model` (head counts), `validate_actor` (micro-batches, kernels, LoRA, the
optimizer) and `validate_rl` (generation, rewards, the PPO loss, groups).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from laden.config.schema import LadenConfig
from laden.config.validate_actor import (
    fused_errors,
    lora_errors,
    micro_batch_errors,
    warn_lora,
    warn_optimizer,
)
from laden.config.validate_agent import agent_errors
from laden.config.validate_alloc import alloc_errors, critic_errors, warn_ignored_sections
from laden.config.validate_model import model_errors
from laden.config.validate_pairs import pair_errors
from laden.config.validate_rl import (
    generation_errors,
    import_path_errors,
    ppo_errors,
    rl_errors,
    warn_ppo,
    warn_rewards,
)
from laden.config.validate_servers import server_errors, server_option_errors

__all__ = ["unwritable_reason", "validate_config"]

_Check = tuple[Callable[[float], bool], str, str]
_CHECKS: dict[str, _Check] = {
    "pos": (lambda v: v >= 1, "at least 1", "set it to a positive integer"),
    "nonneg": (lambda v: v >= 0, "at least 0", "set it to 0 or more"),
    "gt0": (lambda v: v > 0, "greater than 0", "set it to a positive number"),
    "frac": (lambda v: 0 < v <= 1, "in (0, 1]", "set it to a fraction such as 0.8"),
    "unit_open": (lambda v: 0 <= v < 1, "in [0, 1)", "set it to a value such as 0.9 (or 0 for none)"),
    "unit": (lambda v: 0 <= v <= 1, "in [0, 1]", "set it to a fraction between 0 and 1"),
    "open_unit": (lambda v: 0 < v < 1, "in (0, 1)", "set it to a value such as 0.2"),
    "gt1": (
        lambda v: 1 < v < math.inf,
        "a finite number greater than 1",
        "set it to e.g. 3.0, or null for off",
    ),
    "gt0_finite": (
        lambda v: 0 < v < math.inf,
        "a finite number greater than 0",
        "set it to a positive number",
    ),
    "nonneg_finite": (lambda v: 0 <= v < math.inf, "a finite number >= 0", "set it to 0 or more"),
    "finite": (math.isfinite, "a finite number", "set it to a finite number"),
}

_RANGES: dict[str, str] = {
    "seed": "nonneg",
    "total_train_epochs": "pos",
    "total_train_steps": "pos",
    "max_concurrent_rollouts": "pos",
    "log_freq_steps": "pos",
    "reward_timeout_s": "gt0",
    "reward_workers": "pos",
    "reward_error_tolerance": "unit",
    "reward_import_timeout_s": "gt0",
    "reward_worker_max_calls": "pos",
    "reward_worker_max_rss_gb": "gt0",
    "checkpoint.save_every_minutes": "gt0",
    "evaluator.freq_steps": "pos",
    "evaluator.freq_epochs": "pos",
    "evaluator.freq_secs": "gt0",
    "train_dataset.max_length": "pos",
    "train_dataset.batch_size": "pos",
    "valid_dataset.max_length": "pos",
    "valid_dataset.batch_size": "pos",
    "gconfig.n_samples": "pos",
    "gconfig.max_new_tokens": "pos",
    "gconfig.min_new_tokens": "nonneg",
    "gconfig.temperature": "nonneg",
    "gconfig.top_p": "frac",
    "gconfig.top_k": "nonneg",
    "actor.loss_chunk_size": "pos",
    "actor.tiled_mlp_tokens": "pos",
    "actor.weight_chunked_mem_mb": "pos",
    "actor.group_size": "pos",
    "actor.ppo_n_minibatches": "pos",
    "actor.eps_clip_higher": "gt0_finite",
    "actor.c_clip": "gt1",
    "actor.temperature": "gt0_finite",
    "actor.reward_scaling": "finite",
    "actor.reward_bias": "finite",
    "actor.reward_clip": "gt0",
    "actor.overlong_tokens": "pos",
    "actor.overlong_penalty_factor": "nonneg_finite",
    "actor.discount": "unit",
    "actor.gae_lambda": "unit",
    "actor.kl_ctl": "nonneg_finite",
    "actor.beta": "gt0_finite",
    "actor.behav_imp_weight_cap": "gt1",
    "actor.reward_norm.eps": "nonneg_finite",
    "actor.reward_norm.group_size": "pos",
    "actor.adv_norm.eps": "nonneg_finite",
    "actor.adv_norm.group_size": "pos",
    "actor.mb_spec.max_tokens_per_mb": "pos",
    "actor.mb_spec.n_mbs": "pos",
    "actor.optimizer.lr": "gt0",
    "actor.optimizer.weight_decay": "nonneg",
    "actor.optimizer.beta1": "unit_open",
    "actor.optimizer.beta2": "unit_open",
    "actor.optimizer.eps": "gt0",
    "actor.optimizer.momentum": "unit_open",
    "actor.optimizer.warmup_steps_proportion": "unit_open",
    "actor.optimizer.min_lr_ratio": "unit",
    "actor.optimizer.gradient_clipping": "nonneg",
    "actor.fsdp.optim_step_prefetch_layers": "nonneg",
    "actor.lora_rank": "pos",
    "actor.lora_alpha": "gt0",
    "actor.roundpipe.num_microbatch": "pos",
    "actor.roundpipe.model_memory_limit": "gt0",
    "rollout.max_concurrent_rollouts": "pos",
    "rollout.max_head_offpolicyness": "nonneg",
    "rollout.setup_timeout": "nonneg",
    "vllm.gpu_memory_utilization": "frac",
    "vllm.max_model_len": "pos",
    "vllm.max_num_seqs": "pos",
    "vllm.block_size": "pos",
    "vllm.cpu_offload_gb": "nonneg_finite",
    "sglang.mem_fraction_static": "frac",
    "sglang.context_length": "pos",
    "sglang.max_running_requests": "pos",
    "sglang.max_prefill_tokens": "pos",
    "native.mem_fraction_static": "frac",
    "cluster.n_nodes": "pos",
    "cluster.n_gpus_per_node": "nonneg",  # 0: the CPU
    "checkpoint.save_freq_steps": "pos",
    "checkpoint.export_hf_freq_steps": "pos",
    "checkpoint.keep_last": "pos",
}
_RANGES |= {"eval_" + d: kind for d, kind in _RANGES.items() if d.startswith("gconfig.")}
"""Range rule per numeric field; None values (optional fields left unset) are skipped."""
_RANGES |= {"critic.ppo_n_minibatches": "pos", "critic.eps_clip": "gt0"} | {
    "critic" + dotted.removeprefix("actor"): kind
    for dotted, kind in _RANGES.items()
    if dotted.startswith(("actor.mb_spec.", "actor.optimizer.", "actor.fsdp.", "actor.roundpipe."))
}  # the critic's engine sections, as the actor's
_RANGES |= {"teacher.rl_loss_weight": "nonneg_finite", "teacher.distill_loss_weight": "nonneg_finite",
            "teacher.temperature": "gt0_finite"}  # fmt: skip


def validate_config(cfg: LadenConfig, *, job: Literal["sft", "rl", "dpo", "rw", "any"]) -> list[str]:
    """Every cross-field and range error of `cfg` for `job`; warnings for ignored/harmful settings.

    `job="any"` judges the config by `train_dataset.type`.
    """
    rl = job == "rl" or (job == "any" and cfg.train_dataset.type == "rl")
    errors = _range_errors(cfg)
    errors += _name_errors(cfg)
    errors += _job_errors(cfg, job)
    errors += generation_errors(cfg)
    errors += micro_batch_errors(cfg, rl=rl)
    errors += alloc_errors(cfg, rl=rl)
    errors += server_errors(cfg, rl=rl)
    errors += server_option_errors(cfg, rl=rl)
    errors += _alias_errors(cfg)
    errors += fused_errors(cfg)
    errors += import_path_errors(cfg)
    errors += agent_errors(cfg)
    errors += [e for e in ppo_errors(cfg) if e.split("=")[0] not in {r.split("=")[0] for r in errors}]
    errors += lora_errors(cfg)
    errors += critic_errors(cfg, rl=rl)
    if rl:
        errors += rl_errors(cfg)
    errors += pair_errors(cfg, job)
    errors += _fileroot_errors(cfg)
    errors += model_errors(cfg, rl=rl)
    warn_optimizer(cfg)
    warn_lora(cfg)
    warn_rewards(cfg)
    warn_ignored_sections(cfg)
    warn_ppo(cfg, rl=rl)
    return errors


def _get(cfg: LadenConfig, dotted: str) -> object:
    node: object = cfg
    for part in dotted.split("."):
        node = getattr(node, part, None)
    return node


def _range_errors(cfg: LadenConfig) -> list[str]:
    errors = []
    for dotted, kind in _RANGES.items():
        value = _get(cfg, dotted)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # unset optional, or a type error already reported by the loader
        ok, desc, fix = _CHECKS[kind]
        if math.isnan(value) or not ok(value):
            errors.append(f"{dotted}={value!r} must be {desc}; {fix}")
    return errors


def _name_errors(cfg: LadenConfig) -> list[str]:
    errors = []
    for dotted in ("experiment_name", "trial_name", "cluster.fileroot"):
        value = _get(cfg, dotted)
        if not value:
            errors.append(f"{dotted}={value!r} is empty; set it to a name")
        elif dotted != "cluster.fileroot" and "/" in str(value):
            errors.append(f"{dotted}={value!r} contains '/'; use a plain name (it is a directory name)")
    return errors


def _job_errors(cfg: LadenConfig, job: str) -> list[str]:
    if job == "any":
        return []
    errors = []
    if cfg.train_dataset.type != job:
        errors.append(
            f"train_dataset.type={cfg.train_dataset.type!r} does not match the '{job}' job; "
            f"set train_dataset.type: {job}, or run `laden {cfg.train_dataset.type}` for this data"
        )
    if not cfg.train_dataset.path:
        errors.append(
            "train_dataset.path='' is empty; set it to a data file, a dataset directory or hf:<name>"
        )
    if not cfg.actor.path:
        errors.append("actor.path='' is empty; set it to a Hugging Face model directory")
    return errors


def _alias_errors(cfg: LadenConfig) -> list[str]:
    top, nested = cfg.max_concurrent_rollouts, cfg.rollout.max_concurrent_rollouts
    if top is None or nested is None or top == nested:
        return []
    return [
        f"max_concurrent_rollouts={top} conflicts with rollout.max_concurrent_rollouts={nested}; "
        "set only one of them (rollout.max_concurrent_rollouts is the canonical key)"
    ]


# ---------------------------------------------------------------------------------------
# Rules that read the file system (never write to it)


def _fileroot_errors(cfg: LadenConfig) -> list[str]:
    """`cluster.fileroot` must be a directory that run directories can be created in."""
    root = cfg.cluster.fileroot
    if not root:
        return []  # reported as empty by `_name_errors`
    reason = unwritable_reason(Path(root).expanduser())
    if reason is None:
        return []
    return [
        f"cluster.fileroot={root!r} {reason}, so the run directory cannot be created there; set "
        "cluster.fileroot to a writable directory (it is created if missing), e.g. cluster.fileroot=runs"
    ]


def unwritable_reason(path: Path) -> str | None:
    """Why directories cannot be created at `path`, or None; judges its nearest existing ancestor, creates nothing."""
    path = Path(os.path.abspath(path))
    existing = path
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    reason = _not_a_writable_dir(existing)
    if reason is None or existing == path:
        return reason
    return f"does not exist and its nearest existing ancestor {str(existing)!r} {reason}"


def _not_a_writable_dir(directory: Path) -> str | None:
    if not directory.is_dir():
        return "is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable by this user"
    try:
        fs = os.statvfs(directory)
    except OSError as e:
        return f"cannot be inspected ({e.strerror})"
    if fs.f_flag & os.ST_RDONLY:
        return "is on a read-only file system"
    # /proc, /sys and the like report no storage blocks and refuse new directories, even to root.
    if fs.f_blocks == 0:
        return "is on a virtual file system without storage (like /proc or /sys)"
    return None
