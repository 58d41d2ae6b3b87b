"""AReaL's YAML in laden: map the keys laden has a meaning for, accept the rest with a warning.

AReaL's RL and SFT example files load in `laden rl` / `laden sft` unchanged but for model and
dataset paths. `from_areal` rewrites the resolved YAML tree (after overrides and `${...}`
interpolation, before the strict loader) in four passes:

1. Keys that are neither laden's nor AReaL's (`AREAL_KEYS`, every field of AReaL's config
   dataclasses, current and recent versions) inside a section laden does not have are errors,
   with the closest key; unknown keys in laden's own sections are left to the loader.
2. AReaL keys with a laden meaning are mapped: `allocation_mode` -> `rollout.backend` and
   `actor.backend`, `saver.freq_steps` -> `checkpoint.save_freq_steps`, `recover.mode` ->
   `checkpoint.resume`, `actor.init_from_scratch` -> `actor.init_from_config` (the critic's
   likewise; its `is_critic: true` is what laden's `critic` section is), the token-mask
   form of `actor.rejection_sampling` -> `actor.behav_imp_weight_cap`, `async_training: false`
   -> `rollout.max_head_offpolicyness: 0`. Features laden does not have (SAPO, M2PO, a
   teacher, ...) are errors that say so.
3. Copies (`rollout.experiment_name: ${experiment_name}`, `tokenizer_path: ${actor.path}`,
   `rollout.consumer_batch_size: ${train_dataset.batch_size}`, ...) are dropped when they equal
   what they copy, and are errors when they differ, because laden reads the original only.
4. The remaining AReaL keys (schedulers, launchers, name resolution, loggers, server options,
   DataLoader workers, ...) are dropped; each group of them that would have done something in
   AReaL (its value is not null, false, 0, empty or `disabled`) gets one `logging` warning
   naming what laden does instead. Groups irrelevant to the run (the `vllm` section when
   rollouts use SGLang, `ref` without a KL term, every RL section in `laden sft`) are dropped in
   silence, as AReaL ignores them too.

The module is long (about 800 lines) because most of it is data: AReaL's key table and the
groups with their reasons; the passes themselves are short functions.

Trade-off: AReaL's defaults are not applied; a key an AReaL file leaves out takes laden's
default (`actor.kl_ctl` 0 instead of 0.1, `actor.ppo_n_minibatches` 1 instead of 4,
`actor.adv_norm` group mean and std instead of none; the schema names the first two). The
key table must follow AReaL's releases; an AReaL key missing from it is reported as unknown,
never ignored in silence.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import fnmatch
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import yaml

from laden.config.alloc import AllocationMode, split_areal_allocation
from laden.config.schema import LadenConfig
from laden.config.validate import read_model_config

log = logging.getLogger(__name__)

KeyTree = dict[str, Any]
"""AReaL key name -> None (a value, of any type) or the KeyTree of its section."""


def _keys(names: str, **sections: KeyTree) -> KeyTree:
    return {**dict.fromkeys(names.split()), **sections}


_NORM = _keys("mean_level mean_leave1out std_level std_unbiased eps group_size")
_MB_SPEC = _keys("n_mbs max_tokens_per_mb granularity n_mbs_divisor packing_algorithm")
_OPTIMIZER = _keys(
    "type lr weight_decay beta1 beta2 eps min_lr_ratio lr_scheduler_type warmup_steps_proportion offload "
    "initial_loss_scale min_loss_scale loss_scale_window hysteresis gradient_clipping"
)
_FSDP = _keys(
    "offload_params memory_efficient_load per_layer_optim_step optim_step_prefetch_layers shard_vision_across_sp",
    wrap_policy=_keys("transformer_layer_cls_to_wrap"),
)
_ARCHON = _keys(
    "attn_type offload_params enable_compile ac_mode selective_ac_option ac_memory_budget ac_preserve_rng_state "
    "ac_debug pp_schedule pp_layers_per_stage pp_first_stage_less_layers pp_last_stage_less_layers "
    "reshard_after_forward_policy use_deterministic_algorithms moe_router_dtype",
    fp8_config=_keys("mode exclude_modules include_experts use_triton"),
)
_MEGATRON = _keys(
    "wrap_with_ddp use_torch_fsdp2 use_custom_fsdp virtual_pipeline_parallel_size "
    "overlap_param_gather_with_optimizer_step use_precision_aware_optimizer main_grads_dtype main_params_dtype "
    "exp_avg_dtype exp_avg_sq_dtype async_save use_checkpoint_opt_param_scheduler use_deterministic_algorithms "
    "recompute_granularity recompute_method recompute_num_layers distribute_saved_activations recompute_modules "
    "moe_router_dtype moe_shared_expert_overlap moe_enable_deepep moe_token_dispatcher_type moe_permute_fusion "
    "bridge_type use_mbridge_save",
    ddp=_keys(
        "grad_reduce_in_fp32 overlap_grad_reduce overlap_param_gather align_param_gather use_distributed_optimizer "
        "check_for_nan_in_grad bucket_size average_in_collective fp8_param_gather"
    ),
    fp8_config=_keys(
        "mode recipe param margin amax_history_len amax_compute_algo wgrad dot_product_attention "
        "multi_head_attention tp_only_amax_red first_last_layers_bf16 num_layers_at_start_in_bf16 "
        "num_layers_at_end_in_bf16 direct_convert"
    ),
)
_TRAIN_ENGINE = _keys(
    "experiment_name trial_name path attn_impl init_from_scratch init_critic_from_actor pad_to_maximum "
    "disable_dropout gradient_checkpointing dtype grad_reduce_dtype backend ds_auto_tp is_critic weight_update_mode "
    "use_lora lora_rank lora_alpha target_modules peft_type use_kernels temperature enable_tree_training "
    "scheduling_spec offload _version admin_api_key log_level request_timeout setup_timeout",
    mb_spec=_MB_SPEC,
    optimizer=_OPTIMIZER,
    fsdp=_FSDP,
    archon=_ARCHON,
    megatron=_MEGATRON,
    scheduling_strategy=_keys("type target fork"),
)
_PPO_ACTOR = _TRAIN_ENGINE | _keys(
    "group_size ppo_n_minibatches eps_clip eps_clip_higher c_clip m2_threshold reward_scaling reward_bias "
    "reward_clip overlong_reward_penalty overlong_tokens overlong_penalty_factor mask_no_eos_with_zero discount "
    "gae_lambda kl_ctl kl_estimator use_sapo_loss sapo_tau_pos sapo_tau_neg recompute_logprob use_decoupled_loss "
    "behav_imp_weight_cap behave_imp_weight_cap behave_imp_weight_mode importance_sampling_level prox_logp_method "
    "dynamic_sampling log_agent_stats log_agent_stats_keys max_new_tokens",
    reward_norm=_NORM,
    adv_norm=_NORM,
    rejection_sampling=_keys("level action metric agg upper lower"),
)
_GENERATION = _keys(
    "n_samples max_new_tokens min_new_tokens max_tokens greedy top_p top_k temperature stop_token_ids stop "
    "frequency_penalty ignore_eos skip_special_tokens lora_name use_beam_search"
)
_DATASET = _keys(
    "path type batch_size shuffle pin_memory num_workers num_dataset_workers drop_last max_length split "
    "dataset_kwargs scheduling_spec setup_timeout"
)
_TIMER = "experiment_name trial_name fileroot freq_epochs freq_steps freq_secs"
_ROLLOUT = _keys(
    "experiment_name trial_name fileroot max_concurrent_rollouts queue_size consumer_batch_size "
    "max_head_offpolicyness enable_rollout_tracing check_trajectory_format tokenizer_path dump_to_file "
    "setup_timeout request_timeout request_retries pause_grace_period scheduling_spec backend use_lora openai "
    "return_routed_experts schedule_policy _version model routing_strategy poll_interval admin_api_key api_url "
    "provider_api_key",
    scheduling_strategy=_keys("type target fork"),
    agent=_keys(
        "agent_cls_path admin_api_key scheduling_spec mode tool_call_parser reasoning_parser chat_template_type "
        "engine_max_tokens turn_discount export_style subproc_max_workers session_timeout_seconds "
        "set_reward_finish_timeout"
    ),
)
_SGLANG = _keys(
    "model_path random_seed skip_tokenizer_init disable_cuda_graph disable_radix_cache disable_cuda_graph_padding "
    "enable_nccl_nvls disable_outlines_disk_cache disable_custom_all_reduce disable_overlap_schedule "
    "enable_mixed_chunk enable_dp_attention enable_ep_moe enable_torch_compile torch_compile_max_bs "
    "cuda_graph_max_bs cuda_graph_bs torchao_config enable_nan_detection enable_p2p_check "
    "triton_attention_reduce_in_fp32 triton_attention_num_kv_splits num_continuous_decode_steps enable_memory_saver "
    "allow_auto_truncate attention_backend sampling_backend context_length mem_fraction_static max_running_requests "
    "chunked_prefill_size max_prefill_tokens schedule_policy schedule_conservativeness cpu_offload_gb dtype "
    "kv_cache_dtype log_level log_level_http log_requests log_requests_level show_time_cost enable_metrics "
    "decode_log_interval enable_multimodal dp_size ep_size enable_lora max_lora_rank lora_target_modules lora_paths "
    "max_loaded_loras max_loras_per_batch lora_backend enable_multithread_load enable_fast_load "
    "enable_return_routed_experts"
)
_VLLM = _keys(
    "model seed skip_tokenizer_init enforce_eager dtype distributed_executor_backend max_num_seqs block_size "
    "swap_space cpu_offload_gb max_seq_len_to_capture disable_sliding_window max_model_len enable_chunked_prefill "
    "enable_prefix_caching no_enable_chunked_prefill no_enable_prefix_caching gpu_memory_utilization "
    "worker_extension_cls enable_sleep_mode uvicorn_log_level enable_lora max_lora_rank max_loras lora_modules"
)
AREAL_KEYS: KeyTree = _keys(
    "experiment_name trial_name allocation_mode seed enable_offload total_train_epochs total_train_steps "
    "total_train_n_seqs tokenizer_path server_only dynamic_bs async_training",
    cluster=_keys(
        "cluster_name fileroot n_nodes n_gpus_per_node",
        name_resolve=_keys("type nfs_record_root etcd3_addr ray_actor_name"),
    ),
    train_dataset=_DATASET,
    valid_dataset=_DATASET,
    saver=_keys(f"{_TIMER} mode"),
    recover=_keys(f"{_TIMER} mode retries no_save_optim no_load_optim"),
    evaluator=_keys(f"{_TIMER} eval_before_train"),
    stats_logger=_keys(
        "experiment_name trial_name fileroot",
        wandb=_keys(
            "mode entity project name job_type group notes tags config wandb_base_url wandb_api_key id_suffix"
        ),
        swanlab=_keys("project name config logdir mode api_key"),
        tensorboard=_keys("path"),
        trackio=_keys("mode project name space_id"),
    ),
    perf_tracer=_keys(
        "experiment_name trial_name fileroot enabled save_interval profile_steps",
        session_tracer=_keys("enabled flush_threshold"),
    ),
    memory_profiler=_keys("profile_steps max_entries"),
    scheduler=_keys(
        "type endpoint deploy_mode functioncall_service_domain reward_functioncall_config reward_model_path "
        "reward_model_service_url"
    ),
    launcher=_keys(
        "inference_server_cpus_per_gpu inference_server_mem_per_gpu trainer_cpus_per_gpu trainer_mem_per_gpu "
        "inference_server_env_vars trainer_env_vars",
        slurm=_keys(
            "srun_additional_args container_type mount trainer_image inference_server_image additional_bash_cmds"
        ),
    ),
    sglang=_SGLANG,
    vllm=_VLLM,
    gconfig=_GENERATION,
    eval_gconfig=_GENERATION,
    rollout=_ROLLOUT,
    actor=_PPO_ACTOR,
    ref=_PPO_ACTOR,
    critic=_TRAIN_ENGINE | _keys("ppo_n_minibatches eps_clip mask_no_eos_with_zero"),
    teacher=_PPO_ACTOR | _keys("allocation_mode rl_loss_weight distill_loss_weight"),
)
"""Every key of AReaL's experiment configs (`areal/api/cli_args.py`: SFT, PPO/GRPO and their
sections, fields of the releases since AReaL-lite included), as a tree of sections."""

# ---------------------------------------------------------------------------------------
# What happens to the keys laden does not read


@dataclasses.dataclass(frozen=True, slots=True)
class _Run:
    """What the run does, as far as it decides which AReaL groups matter."""

    rl: bool
    rollout: str
    kl: bool
    recover: bool
    evaluator: bool


def _always(run: _Run) -> bool:
    return True


def _never(run: _Run) -> bool:
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    """AReaL keys laden drops, with what laden does instead; `when` says whether they matter in a run."""

    patterns: str
    """Space-separated `fnmatch` patterns of dotted keys (`*` also spans dots)."""
    reason: str
    when: Callable[[_Run], bool] = _always


def _rl(run: _Run) -> bool:
    return run.rl


def _serves(backend: str) -> Callable[[_Run], bool]:
    return lambda run: run.rl and run.rollout == backend


_GROUPS: tuple[_Group, ...] = (
    _Group("actor.sapo_tau_*", "read only with actor.use_sapo_loss, which laden refuses", _never),
    _Group("gconfig.lora_name", "laden's weight updates carry the LoRA-merged weights (actor.use_lora), which "
           "the rollout engine serves as a plain model: no adapter is loaded or named", _rl),
    _Group("sglang.*lora*", "laden's weight updates carry the LoRA-merged weights (actor.use_lora), which SGLang "
           "serves as a plain model: it loads no adapter", _serves("sglang")),
    _Group("sglang.*", "laden starts each SGLang server itself: the model at actor.path, --tp from rollout.backend, "
           "--mem-fraction-static from sglang.mem_fraction_static, the model's own context length; SGLang's other "
           "options are not passed", _serves("sglang")),
    _Group("vllm", "laden starts each vLLM server itself: the model at actor.path, --tensor-parallel-size from "
           "rollout.backend, --gpu-memory-utilization 0.9, the model's own context length; vLLM's other options "
           "are not passed", _serves("vllm")),
    _Group("ref", "laden's reference model for actor.kl_ctl is the initial weights of actor.path, loaded a second "
           "time on the actor's engine (actor.backend, actor.mb_spec, actor.dtype)", lambda run: run.rl and run.kl),
    _Group("critic.attn_impl critic.temperature critic.pad_to_maximum critic.grad_reduce_dtype critic.use_kernels "
           "critic.ds_auto_tp critic.init_critic_from_actor critic.weight_update_mode critic.offload "
           "critic.optimizer.offload", "laden's critic runs with the actor's attention kernel and model patches "
           "(actor.attn_impl), packs micro-batches without padding, starts from critic.path (default actor.path) "
           "with a zero value head, offloads nothing between steps, and its weights never reach the rollout "
           "engine", _rl),
    _Group("critic.lora_rank critic.lora_alpha critic.target_modules critic.peft_type", "read only with "
           "critic.use_lora, which laden refuses", _never),
    _Group("critic.megatron critic.archon", "laden's critic trains on the fsdp or roundpipe engine "
           "(critic.backend); the archon and megatron settings do not apply to it", _rl),
    _Group("critic.fsdp.*", "laden's fsdp engine chooses its own wrapping and sharding", _rl),
    _Group("critic.mb_spec.*", "laden splits a batch into the fewest micro-batches of at most "
           "critic.mb_spec.max_tokens_per_mb tokens (at least critic.mb_spec.n_mbs), without grouping or rounding",
           _rl),
    _Group("critic.optimizer.*", "laden does not scale the loss (it has no fp16 loss scaler)", _rl),
    _Group("eval_gconfig.*", "laden's evaluation reads eval_gconfig.n_samples, max_new_tokens, min_new_tokens, "
           "temperature, top_p, top_k, greedy, stop, stop_token_ids and ignore_eos only", _rl),
    _Group("evaluator.experiment_name evaluator.trial_name evaluator.fileroot", "laden writes the evaluation's "
           "metrics (eval/...) into the run's own metrics.jsonl", lambda run: run.evaluator),
    _Group("recover", "laden resumes from its own checkpoints (checkpoint.resume: auto), written with the optimizer "
           "and data position every checkpoint.save_freq_steps steps and at the end; after a failure, rerun the "
           "command", lambda run: run.recover),
    _Group("saver", "laden checkpoints every checkpoint.save_freq_steps steps (AReaL's saver.freq_steps) and at "
           "the end, and exports a Hugging Face model at the end (checkpoint.export_hf)"),
    _Group("stats_logger perf_tracer memory_profiler rollout.enable_rollout_tracing rollout.dump_to_file "
           "rollout.check_trajectory_format actor.log_agent_stats*", "laden writes every step's metrics to "
           "metrics.jsonl in the run directory; it has no tracer, profiler or experiment-tracker integration"),
    _Group("*_dataset.pin_memory *_dataset.num_workers *_dataset.num_dataset_workers *_dataset.drop_last "
           "*_dataset.setup_timeout", "laden tokenizes the dataset once before training and batches it in the "
           "training process, with no DataLoader workers, dropping an incomplete last training batch"),
    _Group("*_dataset.dataset_kwargs", "laden reads the dataset columns named by prompt_key, completion_key, "
           "messages_key and answer_key; it takes no loader arguments"),
    _Group("scheduler launcher server_only cluster.name_resolve cluster.cluster_name *.scheduling_spec "
           "*.scheduling_strategy", "laden has no scheduler or launcher: run `laden sft` / `laden rl` (under "
           "torchrun for several GPUs, whose rendezvous connects the ranks); laden starts the rollout servers itself"),
    _Group("*._version *.admin_api_key *.log_level *.request_timeout *.setup_timeout rollout.request_retries "
           "rollout.pause_grace_period rollout.poll_interval rollout.api_url rollout.provider_api_key "
           "rollout.routing_strategy rollout.model rollout.agent rollout.openai rollout.schedule_policy "
           "rollout.return_routed_experts", "laden talks to the rollout servers it starts, on the loopback "
           "interface, with no gateway, controller or API key, and with its own timeouts"),
    _Group("rollout.queue_size", "laden generates at most rollout.max_head_offpolicyness batches ahead of the "
           "trainer and keeps no separate queue", _rl),
    _Group("enable_offload actor.offload actor.optimizer.offload", "laden offloads nothing between rollouts and "
           "training; to keep weights, gradients and optimizer states in host memory set "
           "actor.fsdp.offload_params: true, or train with actor.backend: roundpipe:d<N>"),
    _Group("dynamic_bs", "every laden batch holds train_dataset.batch_size prompts; DAPO's dynamic sampling (drop "
           "groups whose rewards are all equal, refill the batch) is actor.dynamic_sampling: true", _rl),
    _Group("total_train_n_seqs", "laden stops after total_train_steps optimizer steps or total_train_epochs "
           "epochs; set total_train_steps"),
    _Group("gconfig.*", "laden's generation reads gconfig.n_samples, max_new_tokens, min_new_tokens, temperature, "
           "top_p, top_k, greedy, stop, stop_token_ids and ignore_eos only", _rl),
    _Group("actor.megatron", "laden has no Megatron-Core: megatron: allocation modes run on laden's archon engine "
           "(PyTorch's pipeline schedules, FSDP2 and tensor parallel within a stage, expert parallel) with their d, p, t "
           "and e; Megatron's "
           "own settings do not apply"),
    _Group("actor.archon.*", "laden's archon engine reads actor.archon.pp_schedule and pp_layers_per_stage; it cuts "
           "stages by parameter bytes plus kept activations (not by layer counts), recomputes whole decoder layers "
           "with actor.gradient_checkpointing, routes experts in the compute dtype, and has no compile or fp8"),
    _Group("actor.fsdp.*", "laden's fsdp engine chooses its own wrapping and sharding"),
    _Group("actor.mb_spec.*", "laden splits a batch into the fewest micro-batches of at most "
           "actor.mb_spec.max_tokens_per_mb tokens (at least actor.mb_spec.n_mbs), without grouping or rounding"),
    _Group("actor.optimizer.*", "laden does not scale the loss (it has no fp16 loss scaler)"),
    _Group("actor.pad_to_maximum actor.grad_reduce_dtype actor.use_kernels actor.ds_auto_tp "
           "actor.init_critic_from_actor", "laden's engines pack micro-batches without padding, reduce gradients "
           "in their own precision and pick attention kernels by actor.attn_impl"),
)  # fmt: skip
"""First match wins, top-down: a section's pattern takes its whole subtree."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Copy:
    """An AReaL key that repeats another one (`rollout.experiment_name: ${experiment_name}`)."""

    pattern: str
    source: str
    when: Callable[[_Run], bool] = _always


_COPIES: tuple[_Copy, ...] = (
    _Copy("*.experiment_name", "experiment_name"),
    _Copy("*.trial_name", "trial_name"),
    _Copy("*.fileroot", "cluster.fileroot"),
    _Copy("tokenizer_path", "actor.path"),
    _Copy("rollout.tokenizer_path", "actor.path", lambda run: run.rl),
    _Copy("rollout.consumer_batch_size", "train_dataset.batch_size", lambda run: run.rl),
    _Copy("actor.max_new_tokens", "gconfig.max_new_tokens", lambda run: run.rl),
    _Copy("rollout.use_lora", "actor.use_lora", lambda run: run.rl),
    *(
        _Copy(f"{section}.{key}", source, _serves(section))
        for section, key, source in (
            ("sglang", "model_path", "actor.path"),
            ("sglang", "random_seed", "seed"),
            ("sglang", "dtype", "actor.dtype"),
            ("vllm", "model", "actor.path"),
            ("vllm", "seed", "seed"),
            ("vllm", "dtype", "actor.dtype"),
        )
    ),
    _Copy("ref.path", "actor.path", lambda run: run.rl and run.kl),
)

_MAPPED = (
    "allocation_mode", "async_training", "saver.freq_steps", "recover.mode", "actor.init_from_scratch",
    "actor.disable_dropout", "actor.rejection_sampling", "actor.behave_imp_weight_cap",
    "actor.behave_imp_weight_mode", "critic.is_critic", "critic.init_from_scratch", "critic.disable_dropout",
)  # fmt: skip
"""AReaL keys whose values land in laden's fields (or are checked against the model)."""

_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("actor.use_sapo_loss", bool, "SAPO's loss is not implemented yet; remove it for the PPO clip loss (actor.eps_clip)"),
    ("actor.m2_threshold", lambda v: v is not None, "M2PO is not implemented yet; remove actor.m2_threshold"),
    ("actor.enable_tree_training", bool, "tree training is not implemented yet; remove it (laden packs sequences)"),
    ("actor.is_critic", bool, "training the actor as a value or reward model is not implemented yet (PPO's value "
     "model is the critic section); remove actor.is_critic"),
    ("critic.use_lora", bool, "LoRA on the critic is not implemented: laden trains all of the value model's weights; "
     "remove critic.use_lora"),
    ("critic.enable_tree_training", bool, "tree training is not implemented yet; remove it (laden packs sequences)"),
    ("actor.prox_logp_method", lambda v: v not in (None, "recompute"),
     "only 'recompute' is implemented (the decoupled loss recomputes the proximal log-probs); set it to recompute"),
    ("teacher", lambda v: v is not None, "distillation from a teacher model is not implemented yet; remove the teacher section"),
)  # fmt: skip
"""AReaL settings laden cannot honour: (key, whether the value asks for the feature, the error)."""

Role = Literal["laden", "mapped", "unsupported", "copy", "ignored"]


def key_role(dotted: str, laden_keys: tuple[str, ...]) -> Role | None:
    """How laden treats an AReaL key (e.g. `saver.freq_steps`), as `from_areal` does; None if not AReaL's.

    The outermost section that is not laden's decides (`stats_logger.wandb.mode` goes with `stats_logger`).
    """
    if _areal_node(dotted) is _MISSING:
        return None
    parts = dotted.split(".")
    prefixes = [".".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
    if any(p in _MAPPED for p in prefixes):  # mapped and refused keys are taken out first
        return "mapped"
    if any(p == key for p in prefixes for key, _, _ in _UNSUPPORTED):
        return "unsupported"
    for prefix in prefixes:
        if prefix in laden_keys:
            if prefix == dotted:
                return "laden"
            continue
        if any(fnmatch.fnmatchcase(prefix, c.pattern) for c in _COPIES):
            return "copy"
        return "ignored" if _group_of(prefix) is not None else None
    return None


def areal_leaf_keys(tree: KeyTree = AREAL_KEYS, prefix: str = "") -> Iterator[str]:
    """Every dotted key of `AREAL_KEYS` that holds a value (not a section)."""
    for name, sub in tree.items():
        if isinstance(sub, dict):
            yield from areal_leaf_keys(sub, f"{prefix}{name}.")
        else:
            yield prefix + name


# ---------------------------------------------------------------------------------------
# The passes


def from_areal(
    raw: dict[str, Any], *, job: str, laden_keys: tuple[str, ...], errors: list[str]
) -> dict[str, Any]:
    """`raw` with AReaL's keys mapped to laden's and the others dropped (see the module docstring).

    Appends an error line per problem to `errors`; `raw` is not modified.
    """
    data = copy.deepcopy(raw)
    laden = _laden_tree(laden_keys)
    _drop_unknown(data, AREAL_KEYS, "", laden, errors)
    _unsupported(data, errors)
    _map_allocation_mode(data, errors)
    run = _run_of(data, job)
    rules = (_map_async, _map_checkpoint, _map_init, _map_dropout, _map_attn_impl, _map_rejection, _map_critic)  # fmt: skip
    for rule in rules:
        rule(data, errors)
    for dotted in ("gconfig.stop", "actor.mb_spec.n_mbs", "sglang.mem_fraction_static"):
        if _get(data, dotted, 0) is None:  # AReaL's null: the engine's default, which laden has too
            _pop(data, dotted)
    if _get(data, "train_dataset.drop_last", None) is True:
        _pop(data, "train_dataset.drop_last")  # what laden does
    hits: dict[_Group, list[str]] = {}
    _sort_out(data, data, "", laden, run, hits, errors)
    for group, items in hits.items():
        kind = "an AReaL setting" if len(items) == 1 and "{" not in items[0] else "AReaL settings"
        log.warning("%s: %s without effect in laden; %s", ", ".join(items), kind, group.reason)
    return data


_MISSING: Any = object()


def _laden_tree(laden_keys: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    """(laden's dotted keys, those of them that are sections)."""
    return _laden_tree_cached(tuple(laden_keys))


@functools.cache
def _laden_tree_cached(laden_keys: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str]]:
    keys = frozenset(laden_keys)
    return keys, frozenset(k.rsplit(".", 1)[0] for k in keys if "." in k)


def _drop_unknown(
    node: dict[str, Any],
    table: KeyTree,
    prefix: str,
    laden: tuple[frozenset[str], frozenset[str]],
    errors: list[str],
) -> None:
    """Report and remove keys that neither laden nor AReaL has, inside sections laden does not have."""
    keys, sections = laden
    laden_parent = prefix == "" or prefix[:-1] in sections
    for key in list(node):
        dotted, value = f"{prefix}{key}", node[key]
        sub = table.get(key, _MISSING) if isinstance(key, str) else _MISSING
        if sub is not _MISSING or dotted in keys:
            if isinstance(value, dict) and (isinstance(sub, dict) or dotted in sections):
                _drop_unknown(value, sub if isinstance(sub, dict) else {}, dotted + ".", laden, errors)
            continue
        if laden_parent:
            continue  # the loader reports it, with laden's closest key
        del node[key]
        known = [f"{prefix}{k}" for k in table]
        close = difflib.get_close_matches(dotted, known, n=1, cutoff=0.6)
        fix = f"did you mean {close[0]}?" if close else "remove it"
        listing = (
            f" (AReaL's keys in {prefix[:-1]}: {', '.join(map(str, table))})" if len(table) <= 16 else ""
        )
        errors.append(f"{dotted}={_short(value)}: unknown key, neither laden's nor AReaL's; {fix}{listing}")


def _unsupported(data: dict[str, Any], errors: list[str]) -> None:
    for dotted, asks, message in _UNSUPPORTED:
        value = _pop(data, dotted)
        if value is not _MISSING and asks(value):
            errors.append(f"{dotted}={_short(value)}: {message}")


def _run_of(data: dict[str, Any], job: str) -> _Run:
    rl = job == "rl" or (job == "any" and _get(data, "train_dataset.type", "sft") == "rl")
    rollout = str(_get(data, "rollout.backend", "native")).partition(":")[0]
    kl = _get(data, "actor.kl_ctl", 0)
    recover = _get(data, "recover.mode", "disabled") in ("on", "auto", "fault", "resume")
    evaluator = _get(data, "valid_dataset", None) is not None
    return _Run(rl=rl, rollout=rollout, kl=isinstance(kl, (int, float)) and kl > 0, recover=recover,
                evaluator=evaluator)  # fmt: skip


def _sort_out(
    root: dict[str, Any],
    node: dict[str, Any],
    prefix: str,
    laden: tuple[frozenset[str], frozenset[str]],
    run: _Run,
    hits: dict[_Group, list[str]],
    errors: list[str],
) -> None:
    """Remove the AReaL keys left under `node`: copies checked, groups recorded in `hits` where they matter."""
    keys, sections = laden
    for key in list(node):
        dotted, value = f"{prefix}{key}", node[key]
        if dotted in keys:
            if isinstance(value, dict) and dotted in sections:
                _sort_out(root, value, dotted + ".", laden, run, hits, errors)
            continue
        if _areal_node(dotted) is _MISSING:
            continue  # not AReaL's: the loader reports it
        del node[key]
        if _check_copy(root, dotted, value, run, errors):
            continue
        group = _group_of(dotted)
        assert group is not None, f"AReaL key {dotted} has no group"  # test_every_areal_key_has_a_role
        if not group.when(run):
            continue
        value = _without_copies(root, value, dotted, run, errors)
        if not _inert(value):
            hits.setdefault(group, []).append(_describe(dotted, value))


def _describe(dotted: str, value: Any) -> str:
    """`key=value`, or `section.{a, b.c}` naming the keys of an AReaL section that ask for something."""
    leaves = list(_set_leaves(dotted, value))
    if len(leaves) == 1:
        return f"{leaves[0][0]}={_short(leaves[0][1])}"
    names = [k.removeprefix(dotted + ".") for k, _ in leaves]
    names = names if len(names) <= 6 else [*names[:5], f"... {len(names) - 5} more"]
    return f"{dotted}.{{{', '.join(names)}}}"


def _set_leaves(dotted: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict) and isinstance(_areal_node(dotted), dict):
        for key, sub in value.items():
            yield from _set_leaves(f"{dotted}.{key}", sub)
    elif not _inert(value):
        yield dotted, value


def _check_copy(root: dict[str, Any], dotted: str, value: Any, run: _Run, errors: list[str]) -> bool:
    """Whether `dotted` is a copy (then an error is added if it differs from its source and matters)."""
    rule = next((c for c in _COPIES if fnmatch.fnmatchcase(dotted, c.pattern)), None)
    if rule is None:
        return False
    if value is None or not rule.when(run):
        return True  # AReaL's null: take the source
    source = _get(root, rule.source, _MISSING)
    if source is _MISSING:
        source = _laden_default(rule.source)
    if value != source:
        errors.append(
            f"{dotted}={_short(value)} differs from {rule.source}={_short(source)}: laden reads {rule.source} "
            f"only; set {dotted}: ${{{rule.source}}} (as AReaL's examples do), or remove it"
        )
    return True


def _without_copies(root: dict[str, Any], value: Any, dotted: str, run: _Run, errors: list[str]) -> Any:
    if not isinstance(value, dict):
        return value
    out = {}
    for key, sub in value.items():
        if not _check_copy(root, f"{dotted}.{key}", sub, run, errors):
            out[key] = _without_copies(root, sub, f"{dotted}.{key}", run, errors)
    return out


def _group_of(dotted: str) -> _Group | None:
    return next((g for g in _GROUPS if any(fnmatch.fnmatchcase(dotted, p) for p in g.patterns.split())), None)


def _areal_node(dotted: str) -> Any:
    node: Any = AREAL_KEYS
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _inert(value: Any) -> bool:
    """Whether a value asks for nothing (null, false, 0, empty, 'disabled'), so dropping it changes nothing."""
    if isinstance(value, dict):
        return all(_inert(v) for v in value.values())
    if isinstance(value, (list, tuple, str)):
        return len(value) == 0 or value == "disabled"
    return value is None or value is False or (isinstance(value, (int, float)) and value == 0)


# ---------------------------------------------------------------------------------------
# Mapped keys


def _map_allocation_mode(data: dict[str, Any], errors: list[str]) -> None:
    """`allocation_mode: sglang:d4p1t1+fsdp:d4p1t1` -> rollout.backend and actor.backend.

    Also the older form `actor.backend: fsdp`, naming only the engine whose dims allocation_mode gives.
    """
    text = _pop(data, "allocation_mode")
    engine = _get(data, "actor.backend", None)
    bare = engine if engine in ("fsdp", "megatron", "archon") else None
    if bare is not None:
        _pop(data, "actor.backend")
    if text in (_MISSING, None):
        if bare is not None:
            errors.append(
                f"actor.backend={bare!r} names an engine without parallel sizes; write "
                f"actor.backend: {bare}:d<N> (e.g. {bare}:d4), or give AReaL's allocation_mode"
            )
        return
    shown = f"allocation_mode={text!r}"
    try:
        rollout, actor, auto = split_areal_allocation(str(text))
    except ValueError as err:
        errors.append(f"{shown}: {err}")
        return
    if rollout is not None:
        _assign(data, "rollout.backend", rollout, shown, errors)
    if actor is not None and bare is not None:
        if not auto and actor.partition(":")[0] != bare:
            errors.append(f"{shown} trains with {actor!r} but actor.backend={bare!r}; make them agree")
            return
        actor = f"{bare}:{actor.partition(':')[2]}"
    if actor is not None:
        _assign(data, "actor.backend", actor, shown, errors)


def _map_async(data: dict[str, Any], errors: list[str]) -> None:
    value = _pop(data, "async_training")
    if value is _MISSING or value is True:
        return  # laden's asynchrony is rollout.max_head_offpolicyness
    if value is not False:
        errors.append(f"async_training={_short(value)}: expected true or false")
        return
    lag = _get(data, "rollout.max_head_offpolicyness", 0)
    if lag:
        log.warning(
            "async_training=false: rollouts are synchronous, so rollout.max_head_offpolicyness=%s is set to 0",
            lag,
        )
    _put(data, "rollout.max_head_offpolicyness", 0)


_RECOVER_MODES = dict.fromkeys(("on", "auto", "fault", "resume"), "auto") | dict.fromkeys(
    ("off", "disabled"), "never"
)


def _map_checkpoint(data: dict[str, Any], errors: list[str]) -> None:
    freq = _pop(data, "saver.freq_steps")
    if freq not in (_MISSING, None):
        _assign(data, "checkpoint.save_freq_steps", freq, f"saver.freq_steps={freq!r}", errors)
    mode = _pop(data, "recover.mode")
    if mode is _MISSING:
        return
    if mode not in _RECOVER_MODES:
        errors.append(f"recover.mode={_short(mode)}: expected one of {', '.join(map(repr, _RECOVER_MODES))}")
        return
    _assign(data, "checkpoint.resume", _RECOVER_MODES[mode], f"recover.mode={mode!r}", errors)


def _map_init(data: dict[str, Any], errors: list[str]) -> None:
    value = _pop(data, "actor.init_from_scratch")
    if value is not _MISSING:
        _assign(data, "actor.init_from_config", value, f"actor.init_from_scratch={_short(value)}", errors)


def _map_dropout(data: dict[str, Any], errors: list[str]) -> None:
    """`disable_dropout: true` is laden's behaviour when the model has no dropout; else say it is kept."""
    for section in ("actor", "critic"):
        if _pop(data, f"{section}.disable_dropout") is True:
            path = _get(data, f"{section}.path", "") or _get(data, "actor.path", "")
            _warn_dropout(section, path)


def _warn_dropout(section: str, path: Any) -> None:
    config, _ = read_model_config(path) if isinstance(path, str) and path else (None, None)
    dropouts = {
        k: v
        for part in (config or {}, (config or {}).get("text_config") or {})
        for k, v in part.items()
        if ("dropout" in k or k.endswith("_pdrop")) and isinstance(v, (int, float)) and v > 0
    }
    if dropouts:
        shown = ", ".join(f"{k}={v}" for k, v in dropouts.items())
        log.warning(
            "%s.disable_dropout=true: an AReaL setting without effect in laden; laden trains with the dropout "
            "of %s/config.json (%s): set those to 0.0 there to train without dropout",
            section,
            path,
            shown,
        )


def _map_critic(data: dict[str, Any], errors: list[str]) -> None:
    """AReaL's `critic` section: `is_critic: true` is what laden's critic is, `init_from_scratch` is
    `critic.init_from_config`, and a bare `backend: fsdp` (older files) names the actor's allocation."""
    is_critic = _pop(data, "critic.is_critic")
    if is_critic is False:
        errors.append(
            "critic.is_critic=false: laden's critic section always trains a value model; remove critic.is_critic, "
            "or set critic: null to train without a critic"
        )
    init = _pop(data, "critic.init_from_scratch")
    if init is not _MISSING:
        _assign(data, "critic.init_from_config", init, f"critic.init_from_scratch={_short(init)}", errors)
    bare, actor = _get(data, "critic.backend", None), _get(data, "actor.backend", "")
    if bare not in ("fsdp", "megatron", "archon"):
        return
    if isinstance(actor, str) and actor.partition(":")[0] == bare:
        _put(data, "critic.backend", actor)
    else:
        errors.append(
            f"critic.backend={bare!r} names an engine without parallel sizes and actor.backend={actor!r} is not a "
            f"{bare} allocation; write critic.backend: {bare}:d<N> (e.g. {bare}:d4), or leave it out for the actor's"
        )


_AREAL_ATTN = {"flash_attention_2": "auto", "flash_attention_3": "auto"}
_LADEN_ATTN = ("auto", "varlen", "sdpa", "eager")


def _map_attn_impl(data: dict[str, Any], errors: list[str]) -> None:
    """AReaL's flash-attention names are laden's `auto` (packed rows, no padding); others fall back to it."""
    value = _get(data, "actor.attn_impl", _MISSING)
    if value in _AREAL_ATTN:
        _put(data, "actor.attn_impl", _AREAL_ATTN[value])
    elif isinstance(value, str) and value not in _LADEN_ATTN and (value == "flex_attention" or "/" in value):
        _pop(data, "actor.attn_impl")
        log.warning(
            "actor.attn_impl=%r: an AReaL setting without effect in laden; laden picks its attention kernel by "
            "actor.attn_impl: auto (the default), varlen, sdpa or eager",
            value,
        )


def _map_rejection(data: dict[str, Any], errors: list[str]) -> None:
    """AReaL's token-mask filter of stale tokens is laden's `actor.behav_imp_weight_cap`."""
    spec, cap = _pop(data, "actor.rejection_sampling"), _pop(data, "actor.behave_imp_weight_cap")
    mode = _pop(data, "actor.behave_imp_weight_mode")
    if not _get(data, "actor.use_decoupled_loss", False):
        if isinstance(spec, dict):  # AReaL ignores it too, and says so
            log.warning(
                "actor.rejection_sampling=%s is ignored without actor.use_decoupled_loss (as in AReaL); set "
                "actor.use_decoupled_loss: true to filter stale tokens",
                _short(spec),
            )
        return
    if isinstance(spec, dict):
        shown = f"actor.rejection_sampling={_short(spec)}"
        form = tuple(spec.get(k, d) for k, d in (("level", "token"), ("action", "mask"), ("metric", "ratio")))
        if form == ("token", "mask", "ratio") and spec.get("lower") is None:
            _assign(data, "actor.behav_imp_weight_cap", spec.get("upper", 5.0), shown, errors)
        else:
            errors.append(
                f"{shown}: only level: token, action: mask, metric: ratio without lower is implemented (laden's "
                "actor.behav_imp_weight_cap: tokens whose behaviour weight exceeds `upper` leave the loss); "
                "change it to that form, or remove it"
            )
    elif cap not in (_MISSING, None) and mode in (_MISSING, "token_mask"):
        _assign(data, "actor.behav_imp_weight_cap", cap, f"actor.behave_imp_weight_cap={cap!r}", errors)
    elif cap not in (_MISSING, None) and mode != "disabled":
        errors.append(
            f"actor.behave_imp_weight_mode={_short(mode)}: only token_mask is implemented "
            "(actor.behav_imp_weight_cap); set it to token_mask or disabled"
        )


# ---------------------------------------------------------------------------------------
# Dotted access to the nested mapping


def _get(data: dict[str, Any], dotted: str, default: Any) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _pop(data: dict[str, Any], dotted: str) -> Any:
    *parents, leaf = dotted.split(".")
    node = _get(data, ".".join(parents), None) if parents else data
    return node.pop(leaf, _MISSING) if isinstance(node, dict) else _MISSING


def _put(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = value


def _assign(data: dict[str, Any], target: str, value: Any, source: str, errors: list[str]) -> None:
    """Set laden's `target` from the AReaL setting `source`; an error if the file sets `target` differently."""
    current = _get(data, target, _MISSING)
    if current is _MISSING or _same(current, value):
        _put(data, target, value)
        return
    errors.append(
        f"{source} gives {target}={_short(value)}, but {target}={_short(current)} is set too; "
        f"set only one of them ({target} is laden's)"
    )


def _same(a: Any, b: Any) -> bool:
    if a == b:
        return True
    try:
        return AllocationMode.parse(a) == AllocationMode.parse(b)  # `fsdp:d4p1t1` is `fsdp:d4`
    except ValueError:
        return False


def _laden_default(dotted: str) -> Any:
    node: Any = LadenConfig()
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _short(value: Any) -> str:
    """A value as the loader shows it (`'text'`, `4`, `true`, `null`), containers shortened."""
    if value is None or isinstance(value, bool):
        return yaml.safe_dump(value).removesuffix("\n...\n").strip()
    text = repr(value)
    if len(text) <= 60:
        return text
    if isinstance(value, list):
        return f"[{len(value)} item{'s' * (len(value) != 1)}]"
    if isinstance(value, dict):
        return f"{{{', '.join(map(str, value))}}}"[:60]
    return text[:57] + "..."
