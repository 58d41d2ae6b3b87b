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
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from laden.config.alloc import AllocationMode, check_alloc, head_rule_errors
from laden.config.schema import LadenConfig

SERVER_ROLLOUT_BACKENDS = ("sglang", "vllm")
"""Rollout backends that run as separate servers on GPUs of their own."""

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
    "actor.eps_clip": "open_unit",
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
    "sglang.mem_fraction_static": "frac",
    "native.mem_fraction_static": "frac",
    "cluster.n_nodes": "pos",
    "cluster.n_gpus_per_node": "pos",
    "checkpoint.save_freq_steps": "pos",
    "checkpoint.keep_last": "pos",
}
_RANGES |= {"eval_" + d: kind for d, kind in _RANGES.items() if d.startswith("gconfig.")}
"""Range rule per numeric field; None values (optional fields left unset) are skipped."""
_RANGES |= {"critic.ppo_n_minibatches": "pos", "critic.eps_clip": "gt0"} | {
    "critic" + dotted.removeprefix("actor"): kind
    for dotted, kind in _RANGES.items()
    if dotted.startswith(("actor.mb_spec.", "actor.optimizer.", "actor.fsdp.", "actor.roundpipe."))
}  # the critic's engine sections, as the actor's


def validate_config(cfg: LadenConfig, *, job: Literal["sft", "rl", "any"]) -> list[str]:
    """Every cross-field and range error of `cfg` for `job`; warnings for ignored/harmful settings.

    `job="any"` judges the config by `train_dataset.type`.
    """
    rl = job == "rl" or (job == "any" and cfg.train_dataset.type == "rl")
    errors = _range_errors(cfg)
    errors += _name_errors(cfg)
    errors += _job_errors(cfg, job)
    errors += _generation_errors(cfg)
    errors += _micro_batch_errors(cfg, rl=rl)
    errors += _alloc_errors(cfg, rl=rl)
    errors += _alias_errors(cfg)
    errors += _fused_errors(cfg)
    errors += _import_path_errors(cfg)
    errors += _ppo_errors(cfg)
    errors += _lora_errors(cfg)
    errors += _critic_errors(cfg, rl=rl)
    if rl:
        errors += _rl_errors(cfg)
    errors += _fileroot_errors(cfg)
    errors += _model_errors(cfg, rl=rl)
    _warn_optimizer(cfg)
    _warn_lora(cfg)
    _warn_rewards(cfg)
    _warn_ignored_sections(cfg)
    _warn_ppo(cfg, rl=rl)
    return errors


def validate_against_model(
    cfg: LadenConfig, *, num_attention_heads: int, num_key_value_heads: int | None, rollout: bool = True
) -> list[str]:
    """Head-rule errors for actor `t`, `c` (and their product) and, if `rollout`, rollout `t`."""
    errors: list[str] = []
    heads = (num_attention_heads, num_key_value_heads)
    actor = _parse_or_none(cfg.actor.backend)
    if actor is not None:
        field = f"actor.backend={cfg.actor.backend!r}"
        for size, axis in ((actor.tp, "tensor (t)"), (actor.cp, "context (c)")):
            errors += head_rule_errors(size, *heads, field=field, axis_name=axis)
        if actor.tp > 1 and actor.cp > 1 and not errors:
            errors += head_rule_errors(actor.tp * actor.cp, *heads, field=field, axis_name="t*c")
    rollout_mode = _parse_or_none(cfg.rollout.backend) if rollout else None
    if rollout_mode is not None:
        field = f"rollout.backend={cfg.rollout.backend!r}"
        errors += head_rule_errors(rollout_mode.tp, *heads, field=field, axis_name="tensor (t)")
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
            f"set train_dataset.type: {job}"
        )
    if not cfg.train_dataset.path:
        errors.append(
            "train_dataset.path='' is empty; set it to a data file, a dataset directory or hf:<name>"
        )
    if not cfg.actor.path:
        errors.append("actor.path='' is empty; set it to a Hugging Face model directory")
    return errors


def _generation_errors(cfg: LadenConfig) -> list[str]:
    errors = []
    for name, g in (("gconfig", cfg.gconfig), ("eval_gconfig", cfg.eval_gconfig)):
        if g is None:
            continue
        if g.min_new_tokens > g.max_new_tokens:
            errors.append(
                f"{name}.min_new_tokens={g.min_new_tokens} is larger than {name}.max_new_tokens="
                f"{g.max_new_tokens}; set it to at most {g.max_new_tokens}"
            )
        if g.temperature == 0 and not g.greedy:
            errors.append(
                f"{name}.temperature=0.0 cannot be sampled from; set {name}.greedy: true for greedy "
                "decoding or a temperature > 0"
            )
    return errors


def _micro_batch_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    """A micro-batch must hold the longest sequence: max_length (+ max_new_tokens for RL)."""
    budget = cfg.actor.mb_spec.max_tokens_per_mb
    if budget is None:
        return []
    need = cfg.train_dataset.max_length
    terms = "train_dataset.max_length"
    if rl:
        need += cfg.gconfig.max_new_tokens
        terms += " + gconfig.max_new_tokens"
    if budget >= need:
        return []
    return [
        f"actor.mb_spec.max_tokens_per_mb={budget} is smaller than {terms} = {need}; "
        f"set it to at least {need}"
    ]


def _alloc_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    errors = check_alloc(cfg.actor.backend, role="actor", field="actor.backend")
    if rl:
        errors += check_alloc(cfg.rollout.backend, role="rollout", field="rollout.backend")
    if cfg.actor.optimizer.type == "adam_bf16" and cfg.actor.backend.startswith("megatron:"):
        errors.append(
            "actor.optimizer.type='adam_bf16' is not supported by the megatron backend; use adam or sgd"
        )
    if errors or cfg.cluster.n_nodes < 1 or cfg.cluster.n_gpus_per_node < 1:
        return errors
    return _gpu_total_errors(cfg, rl=rl)


def _gpu_total_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    nodes, per_node = cfg.cluster.n_nodes, cfg.cluster.n_gpus_per_node
    total = nodes * per_node
    have = f"cluster.n_nodes * cluster.n_gpus_per_node = {nodes} * {per_node} = {total}"
    actor = AllocationMode.parse(cfg.actor.backend)
    errors = []
    if actor.num_gpus > total:
        errors.append(
            f"actor.backend={cfg.actor.backend!r} needs {actor.num_gpus} GPUs but {have}; "
            "lower its parallel sizes or raise cluster.n_gpus_per_node / cluster.n_nodes"
        )
    if not rl:
        return errors
    rollout = AllocationMode.parse(cfg.rollout.backend)
    if rollout.backend in SERVER_ROLLOUT_BACKENDS:
        need = actor.num_gpus + rollout.num_gpus
        if need > total and actor.num_gpus <= total:
            errors.append(
                f"rollout.backend={cfg.rollout.backend!r} needs {rollout.num_gpus} GPUs of its own "
                f"next to actor.backend={cfg.actor.backend!r} ({actor.num_gpus}): {need} GPUs but "
                f"{have}; lower the parallel sizes, add GPUs, or use rollout.backend: native:d... "
                "(it shares the training GPUs)"
            )
    elif rollout.num_gpus > total:
        errors.append(
            f"rollout.backend={cfg.rollout.backend!r} needs {rollout.num_gpus} GPUs but {have}; "
            "lower its parallel sizes or add GPUs"
        )
    return errors


def _alias_errors(cfg: LadenConfig) -> list[str]:
    top, nested = cfg.max_concurrent_rollouts, cfg.rollout.max_concurrent_rollouts
    if top is None or nested is None or top == nested:
        return []
    return [
        f"max_concurrent_rollouts={top} conflicts with rollout.max_concurrent_rollouts={nested}; "
        "set only one of them (rollout.max_concurrent_rollouts is the canonical key)"
    ]


def _fused_errors(cfg: LadenConfig) -> list[str]:
    if cfg.actor.fused_elementwise is True and not cfg.actor.lean_activations:
        return [
            "actor.fused_elementwise=true needs actor.lean_activations=true: the fused kernels are the "
            "lean RMSNorm's and gated MLP's math; set actor.lean_activations: true or drop fused_elementwise"
        ]
    return []


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?")


def _import_path_errors(cfg: LadenConfig) -> list[str]:
    """`reward_fn` and `workflow` name an object as `module:name` (or `module.name`); nothing is imported here."""
    errors = []
    for dotted, example in (
        ("reward_fn", "laden.rl.rewards:math_reward"),
        ("workflow", "laden.rl.workflow:RLVRWorkflow"),
    ):
        value = getattr(cfg, dotted)
        if not (_IMPORT_PATH.fullmatch(value) and ("." in value or ":" in value)):
            errors.append(
                f"{dotted}={value!r} is not an import path; write `module:name`, e.g. {dotted}={example}"
            )
    for i, spec in enumerate(cfg.reward_fns):
        if not (_IMPORT_PATH.fullmatch(spec.fn) and ("." in spec.fn or ":" in spec.fn)):
            errors.append(
                f"reward_fns[{i}].fn={spec.fn!r} is not an import path; write `module:name`, e.g. "
                "laden.rl.rewards:math_reward"
            )
        if not math.isfinite(spec.weight):
            errors.append(
                f"reward_fns[{i}].weight={spec.weight!r} must be a finite number; set it to e.g. 1.0"
            )
    return errors


def _lora_errors(cfg: LadenConfig) -> list[str]:
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
    mode = _parse_or_none(a.backend)
    if a.use_lora and mode is not None and mode.tp > 1:
        errors.append(
            f"actor.use_lora=true with actor.backend={a.backend!r}: tensor parallelism shards the plain linear "
            "projections that LoRA wraps; use t=1 (e.g. "
            f"{mode.backend}:d{mode.dp * mode.tp}" + (f"c{mode.cp}" if mode.cp > 1 else "") + "), or "
            "actor.use_lora: false"
        )
    return errors


def _warn_rewards(cfg: LadenConfig) -> None:
    default = LadenConfig()
    changed = [f for f in ("reward_fn", "reward_fn_style") if getattr(cfg, f) != getattr(default, f)]
    if cfg.reward_fns and changed:
        warnings.warn(
            f"{', '.join(f'{f}={getattr(cfg, f)!r}' for f in changed)} ignored: reward_fns is set and names every "
            "reward function with its own style; add it to reward_fns, or remove reward_fns",
            UserWarning,
            stacklevel=3,
        )


def _warn_lora(cfg: LadenConfig) -> None:
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


def _ppo_errors(cfg: LadenConfig) -> list[str]:
    """Fields of the PPO loss and reward shaping that only make sense together."""
    a = cfg.actor
    errors = []
    if a.behav_imp_weight_cap is not None and not a.use_decoupled_loss:
        errors.append(
            f"actor.behav_imp_weight_cap={a.behav_imp_weight_cap} is only read by the decoupled loss; set "
            "actor.use_decoupled_loss: true, or actor.behav_imp_weight_cap: null"
        )
    if a.overlong_reward_penalty:
        if a.overlong_tokens is None:
            errors.append(
                "actor.overlong_tokens=null is required by actor.overlong_reward_penalty=true (the penalised "
                "tail of the generation budget); set it to a token count, e.g. actor.overlong_tokens: 256"
            )
        if a.overlong_penalty_factor is None:
            errors.append(
                "actor.overlong_penalty_factor=null is required by actor.overlong_reward_penalty=true (the "
                "penalty at gconfig.max_new_tokens); set it, e.g. actor.overlong_penalty_factor: 1.0"
            )
    return errors


def _critic_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    """The critic trains in the actor's processes, on the same data split, unsharded over tensors."""
    c = cfg.critic
    if c is None:
        return []
    errors = check_alloc(c.backend, role="actor", field="critic.backend") if c.backend else []
    critic, actor = _parse_or_none(c.backend or cfg.actor.backend), _parse_or_none(cfg.actor.backend)
    if errors or critic is None or actor is None:
        return errors  # actor.backend's own errors are reported by `_alloc_errors`
    shown = f"critic.backend={c.backend!r}" if c.backend else f"critic.backend='' ({cfg.actor.backend!r})"
    if critic.backend in ("archon", "megatron"):
        errors.append(
            f"{shown}: the critic's value head does not run on the archon engine yet; set critic.backend: "
            f"fsdp:d{critic.num_gpus}"
        )
    elif actor.tp > 1:
        errors.append(
            f"actor.backend={cfg.actor.backend!r} with a critic: the critic trains in the actor's processes and its "
            "one-output value head has no tensor-parallel split; use t=1 in actor.backend (e.g. "
            f"{actor.backend}:d{actor.dp * actor.tp}), or remove the critic section"
        )
    elif critic.tp > 1:
        errors.append(
            f"{shown} splits the critic over t={critic.tp} tensor-parallel ranks, but its one-output value head "
            f"has no tensor-parallel split; set critic.backend: {critic.backend}:d{actor.dp}"
            + (f"c{actor.cp}" if actor.cp > 1 else "")
        )
    elif (critic.dp, critic.cp, critic.num_gpus) != (actor.dp, actor.cp, actor.num_gpus):
        errors.append(
            f"{shown} must train in the actor's processes on the actor's share of each batch: d={actor.dp} and "
            f"c={actor.cp} as actor.backend={cfg.actor.backend!r} has; set critic.backend: "
            f"{critic.backend}:d{actor.dp}" + (f"c{actor.cp}" if actor.cp > 1 else "") + ", or leave it ''"
        )
    budget = None if c.mb_spec is None else c.mb_spec.max_tokens_per_mb
    need = cfg.train_dataset.max_length + cfg.gconfig.max_new_tokens
    if rl and budget is not None and budget < need:
        errors.append(
            f"critic.mb_spec.max_tokens_per_mb={budget} is smaller than train_dataset.max_length + "
            f"gconfig.max_new_tokens = {need}; set it to at least {need}"
        )
    return errors


def _rl_errors(cfg: LadenConfig) -> list[str]:
    """RL rules that involve the generation settings or the actor's parallelism."""
    return _sequence_level_errors(cfg) + _group_errors(cfg) + _overlong_budget_errors(cfg)


def _sequence_level_errors(cfg: LadenConfig) -> list[str]:
    """Sequence-level ratios and averages need whole sequences; context parallelism slices them."""
    mode = _parse_or_none(cfg.actor.backend)
    if mode is None or mode.cp <= 1:
        return []
    a, errors = cfg.actor, []
    split = f"actor.backend={a.backend!r} splits every sequence over c={mode.cp} context-parallel ranks"
    if a.importance_sampling_level == "sequence":
        errors.append(
            f"actor.importance_sampling_level='sequence' needs whole sequences, but {split}; train with c=1 "
            "in actor.backend, or set actor.importance_sampling_level: token"
        )
    if a.loss_agg_mode == "seq-mean-token-mean":
        errors.append(
            f"actor.loss_agg_mode='seq-mean-token-mean' needs whole sequences, but {split}; train with c=1 "
            "in actor.backend, or set actor.loss_agg_mode: token-mean"
        )
    return errors


def _group_errors(cfg: LadenConfig) -> list[str]:
    """laden's groups are each prompt's `gconfig.n_samples` completions; AReaL's copies of it must agree."""
    n, a = cfg.gconfig.n_samples, cfg.actor
    errors = []
    sizes = {"actor.group_size": a.group_size}
    for name in ("reward_norm", "adv_norm"):
        norm = getattr(a, name)
        if norm is not None:
            sizes[f"actor.{name}.group_size"] = norm.group_size
    for dotted, size in sizes.items():
        if size >= 1 and size not in (1, n):  # sizes < 1 are range errors
            errors.append(
                f"{dotted}={size} does not match gconfig.n_samples={n}: a group is one prompt's completions; "
                f"set gconfig.n_samples: {size} (AReaL writes {dotted.rsplit('.', 1)[-1]}: "
                f"${{gconfig.n_samples}}), or {dotted}: {n}"
            )
    if a.dynamic_sampling and n == 1:
        errors.append(
            "actor.dynamic_sampling=true with gconfig.n_samples=1 drops every group (the rewards of a group "
            "of one are all equal); set gconfig.n_samples to 2 or more, or actor.dynamic_sampling: false"
        )
    return errors


def _overlong_budget_errors(cfg: LadenConfig) -> list[str]:
    tokens, budget = cfg.actor.overlong_tokens, cfg.gconfig.max_new_tokens
    if not cfg.actor.overlong_reward_penalty or tokens is None or tokens <= budget:
        return []
    return [
        f"actor.overlong_tokens={tokens} is larger than gconfig.max_new_tokens={budget}, the generation "
        f"budget whose tail it penalises; set it to at most {budget}"
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


_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")


def _model_errors(cfg: LadenConfig, *, rl: bool) -> list[str]:
    """The head rules of `validate_against_model` on `actor.path`/config.json, read without the weights."""
    path = cfg.actor.path
    if not path:
        return []  # reported by `_job_errors` where the job needs a model
    config, error = read_model_config(path)
    if error is not None:
        return [error]
    if config is None:
        return []  # a .gguf file: its heads are checked once it is loaded
    heads = _first_int(config, _HEAD_KEYS)
    if heads is None:
        return []  # an architecture without a head count: nothing to divide
    kv_heads = _first_int(config, _KV_HEAD_KEYS) or heads
    errors = validate_against_model(cfg, num_attention_heads=heads, num_key_value_heads=kv_heads, rollout=rl)
    source = Path(path).expanduser() / "config.json"
    return [f"{e} (head counts from {source})" for e in errors]


def read_model_config(path: str) -> tuple[dict[str, Any] | None, str | None]:
    """(`config.json` of the model at `path`, None), (None, None) for a .gguf file, or (None, error line)."""
    field = f"actor.path={path!r}"
    directory = Path(path).expanduser()
    if not directory.exists():
        return None, (
            f"{field} does not exist; laden loads local directories only (model hubs are not reachable): "
            "download the model (e.g. `huggingface-cli download <repo> --local-dir <dir>`) and set "
            "actor.path to that directory"
        )
    if directory.is_file():
        if directory.suffix == ".gguf":
            return None, None
        return (
            None,
            f"{field} is a file; set it to a Hugging Face model directory (config.json + weights) or a .gguf file",
        )
    file = directory / "config.json"
    if not file.is_file():
        return None, (
            f"{field} has no config.json; set actor.path to a Hugging Face model directory (config.json "
            "plus weights, as written by `save_pretrained`) or to a .gguf file"
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return (
            None,
            f"{field}: {file} cannot be read ({e}); re-download the model or re-save it with `save_pretrained`",
        )
    if not isinstance(config, dict):
        return (
            None,
            f"{field}: {file} holds a {type(config).__name__}, not a JSON object; re-download the model",
        )
    return config, None


def _first_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    """The first integer under `keys`, at the top level or in `text_config` (multimodal models)."""
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        for key in keys:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _warn_optimizer(cfg: LadenConfig) -> None:
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


def _warn_ignored_sections(cfg: LadenConfig) -> None:
    backend = cfg.actor.backend.partition(":")[0]
    backend = "archon" if backend == "megatron" else backend  # megatron: modes run on the archon engine
    for section in ("fsdp", "roundpipe", "archon"):
        value = getattr(cfg.actor, section)
        if backend != section and value != type(value)():
            changed = [
                f.name
                for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(type(value)(), f.name)
            ]
            warnings.warn(
                f"actor.{section}.{{{', '.join(changed)}}} are ignored because actor.backend="
                f"{cfg.actor.backend!r} is not a {section} backend; remove them or switch backend",
                UserWarning,
                stacklevel=3,
            )


def _warn_ppo(cfg: LadenConfig, *, rl: bool) -> None:
    """RL settings that are legal but ignored or known to hurt (sft names them via `usage`)."""
    if not rl:
        return
    a, g = cfg.actor, cfg.gconfig
    ignored = [f for f in ("overlong_tokens", "overlong_penalty_factor") if getattr(a, f) is not None]
    if ignored and not a.overlong_reward_penalty:
        warnings.warn(
            f"actor.{{{', '.join(ignored)}}} are ignored because actor.overlong_reward_penalty=false; set it "
            "to true to penalise overlong completions, or remove them",
            UserWarning,
            stacklevel=3,
        )
    if not g.greedy and a.temperature != g.temperature and a.temperature > 0:
        warnings.warn(
            f"actor.temperature={a.temperature} differs from gconfig.temperature={g.temperature}: the trainer's "
            "log-probs are then of another distribution than the one sampled, which biases every importance "
            f"ratio; set actor.temperature: {g.temperature}",
            UserWarning,
            stacklevel=3,
        )
    grouped = [
        f"actor.{name}"
        for name in ("reward_norm", "adv_norm")
        if getattr(a, name) is not None and getattr(a, name).mean_level == "group"
    ]
    if grouped and g.n_samples == 1:
        verb = "subtract" if len(grouped) > 1 else "subtracts"
        warnings.warn(
            f"{' and '.join(grouped)} {verb} each group's mean, but gconfig.n_samples=1 makes every group one "
            "completion, so every advantage is 0 and nothing is learned; set gconfig.n_samples to 2 or more "
            "(GRPO), or mean_level: batch",
            UserWarning,
            stacklevel=3,
        )


def _parse_or_none(text: str) -> AllocationMode | None:
    try:
        return AllocationMode.parse(text)
    except ValueError:
        return None
