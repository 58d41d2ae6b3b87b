"""AReaL's configuration keys, as `laden.config.areal` sorts them: the tables, not the passes.

`AREAL_KEYS` holds every key of AReaL's experiment configs as a tree of sections; the tables
below it say what becomes of the keys laden does not read: `MAPPED` (their values land in
laden's fields), `UNSUPPORTED` (features laden refuses, with the error), `COPIES` (keys that
repeat another one and must equal it) and `GROUPS` (keys dropped, with what laden does instead
and the runs in which they matter). `key_role` answers, for one dotted key, which of these it is.

Most of this module is data; it must follow AReaL's releases, since an AReaL key missing from
`AREAL_KEYS` is reported as unknown, never ignored in silence.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterator
from typing import Any, Literal

from laden.config.dotted import MISSING, get_dotted

__all__ = [
    "AREAL_KEYS",
    "COPIES",
    "GROUPS",
    "MAPPED",
    "MISSING",
    "UNSUPPORTED",
    "Copy",
    "Group",
    "KeyTree",
    "Role",
    "Run",
    "areal_leaf_keys",
    "areal_node",
    "group_of",
    "key_role",
]


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
    # the flat form of AReaL's example (a train engine's keys), and TeacherConfig's `train` / `rollout` form
    teacher=_PPO_ACTOR
    | _keys(
        "allocation_mode rl_loss_weight distill_loss_weight engine_type", train=_PPO_ACTOR, rollout=_ROLLOUT
    ),
)
"""Every key of AReaL's experiment configs (`areal/api/cli_args.py`: SFT, PPO/GRPO and their
sections, fields of the releases since AReaL-lite included), as a tree of sections."""

# ---------------------------------------------------------------------------------------
# What happens to the keys laden does not read


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """What the run does, as far as it decides which AReaL groups matter."""

    rl: bool
    rollout: str
    kl: bool
    recover: bool
    evaluator: bool
    pairs: str | None = None
    """`dpo` or `rw` for a preference-pair job (`laden dpo`, `laden rw`), else None."""


def _always(run: Run) -> bool:
    return True


def _never(run: Run) -> bool:
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    """AReaL keys laden drops, with what laden does instead; `when` says whether they matter in a run."""

    patterns: str
    """Space-separated `fnmatch` patterns of dotted keys (`*` also spans dots)."""
    reason: str
    when: Callable[[Run], bool] = _always


def _rl(run: Run) -> bool:
    return run.rl


def _serves(backend: str) -> Callable[[Run], bool]:
    return lambda run: run.rl and run.rollout == backend


GROUPS: tuple[Group, ...] = (
    Group("gconfig.lora_name", "laden's weight updates carry the LoRA-merged weights (actor.use_lora), which "
           "the rollout engine serves as a plain model: no adapter is loaded or named", _rl),
    Group("sglang.*lora*", "laden's weight updates carry the LoRA-merged weights (actor.use_lora), which SGLang "
           "serves as a plain model: it loads no adapter", _serves("sglang")),
    Group("sglang.*", "laden starts each SGLang server itself: the model at actor.path, --tp from rollout.backend, "
           "and of the sglang section mem_fraction_static, context_length, max_running_requests, "
           "chunked_prefill_size, max_prefill_tokens, disable_radix_cache, attention_backend and enable_metrics; "
           "SGLang's other options are not passed", _serves("sglang")),
    Group("vllm.no_enable_prefix_caching vllm.no_enable_chunked_prefill", "laden's fields are "
           "vllm.enable_prefix_caching and vllm.enable_chunked_prefill (false passes --no-enable-...); set "
           "vllm.enable_prefix_caching: false instead of vllm.no_enable_prefix_caching: true",
           _serves("vllm")),
    Group("vllm.*", "laden starts each vLLM server itself: the model at actor.path, --tensor-parallel-size from "
           "rollout.backend, and of the vllm section gpu_memory_utilization, max_model_len, max_num_seqs, "
           "enable_prefix_caching, enable_chunked_prefill, enforce_eager, block_size and cpu_offload_gb; vLLM's "
           "other options are not passed (vLLM 0.32 has no swap_space)", _serves("vllm")),
    Group("ref", "laden's reference model (actor.kl_ctl's in `laden rl`, DPO's in `laden dpo`) is the initial weights "
           "of actor.path on the actor's engine (actor.backend, actor.mb_spec, actor.dtype): `laden rl` loads them a "
           "second time, `laden dpo` computes their log-probs of every pair once before the first step",
          lambda run: (run.rl and run.kl) or run.pairs == "dpo"),
    Group("critic.attn_impl critic.temperature critic.pad_to_maximum critic.grad_reduce_dtype critic.use_kernels "
           "critic.ds_auto_tp critic.init_critic_from_actor critic.weight_update_mode critic.offload "
           "critic.optimizer.offload", "laden's critic runs with the actor's attention kernel and model patches "
           "(actor.attn_impl), packs micro-batches without padding, starts from critic.path (default actor.path) "
           "with a zero value head, offloads nothing between steps, and its weights never reach the rollout "
           "engine", _rl),
    Group("critic.lora_rank critic.lora_alpha critic.target_modules critic.peft_type", "read only with "
           "critic.use_lora, which laden refuses", _never),
    Group("critic.megatron", "laden has no Megatron-Core: the critic's megatron: modes run on laden's archon engine "
           "(critic.archon's settings); Megatron's own settings do not apply", _rl),
    Group("critic.archon.*", "laden's archon engine reads critic.archon.pp_schedule and pp_layers_per_stage (unset: "
           "actor.archon's); the rest as for actor.archon", _rl),
    Group("critic.fsdp.*", "laden's fsdp engine chooses its own wrapping and sharding", _rl),
    Group("critic.mb_spec.*", "laden splits a batch into the fewest micro-batches of at most "
           "critic.mb_spec.max_tokens_per_mb tokens (at least critic.mb_spec.n_mbs), without grouping or rounding",
           _rl),
    Group("critic.optimizer.*", "laden does not scale the loss (it has no fp16 loss scaler)", _rl),
    Group("eval_gconfig.*", "laden's evaluation reads eval_gconfig.n_samples, max_new_tokens, min_new_tokens, "
           "temperature, top_p, top_k, greedy, stop, stop_token_ids and ignore_eos only", _rl),
    Group("evaluator.experiment_name evaluator.trial_name evaluator.fileroot", "laden writes the evaluation's "
           "metrics (eval/...) into the run's own metrics.jsonl", lambda run: run.evaluator),
    Group("recover", "laden resumes from its own checkpoints (checkpoint.resume: auto), written with the optimizer "
           "and data position every checkpoint.save_freq_steps steps and at the end; after a failure, rerun the "
           "command", lambda run: run.recover),
    Group("saver", "laden checkpoints every checkpoint.save_freq_steps steps (AReaL's saver.freq_steps) and at "
           "the end, and exports a Hugging Face model at the end (checkpoint.export_hf)"),
    Group("perf_tracer memory_profiler rollout.enable_rollout_tracing rollout.dump_to_file "
           "rollout.check_trajectory_format actor.log_agent_stats*", "laden writes every step's metrics to "
           "metrics.jsonl in the run directory (and to the trackers of stats_logger); it has no tracer or "
           "profiler"),
    Group("*_dataset.pin_memory *_dataset.num_workers *_dataset.num_dataset_workers *_dataset.drop_last "
           "*_dataset.setup_timeout", "laden tokenizes the dataset once before training and batches it in the "
           "training process, with no DataLoader workers, dropping an incomplete last training batch"),
    Group("scheduler launcher server_only cluster.name_resolve cluster.cluster_name *.scheduling_spec "
           "*.scheduling_strategy", "laden has no scheduler or launcher: run `laden sft` / `laden rl` (under "
           "torchrun for several GPUs, whose rendezvous connects the ranks); laden starts the rollout servers itself, "
           "or attaches to those of rollout.server_urls (started by `laden serve`, docs/multinode.md)"),
    Group("*._version *.admin_api_key *.log_level *.request_timeout *.setup_timeout rollout.request_retries "
           "rollout.pause_grace_period rollout.poll_interval rollout.api_url rollout.provider_api_key "
           "rollout.routing_strategy rollout.model rollout.openai rollout.schedule_policy "
           "rollout.return_routed_experts", "laden talks to the rollout servers directly (those it starts, or "
           "those of rollout.server_urls), with no gateway, controller or API key, and with its own request "
           "timeouts"),
    Group("rollout.agent.agent_cls_path rollout.agent.session_timeout_seconds rollout.agent.set_reward_finish_timeout",
          "laden runs each agent episode as its agent's run() against an endpoint in the training process "
          "(rollout.agent.mode inline or subproc): the episode's session ends when run() returns, with no agent "
          "service, gateway or session timeout", _rl),
    Group("rollout.queue_size", "laden generates at most rollout.max_head_offpolicyness batches ahead of the "
           "trainer and keeps no separate queue", _rl),
    Group("enable_offload actor.offload actor.optimizer.offload", "laden offloads nothing between rollouts and "
           "training; to keep weights, gradients and optimizer states in host memory set "
           "actor.fsdp.offload_params: true, or train with actor.backend: roundpipe:d<N>"),
    Group("dynamic_bs", "every laden batch holds train_dataset.batch_size prompts; DAPO's dynamic sampling (drop "
           "groups whose rewards are all equal, refill the batch) is actor.dynamic_sampling: true", _rl),
    Group("total_train_n_seqs", "laden stops after total_train_steps optimizer steps or total_train_epochs "
           "epochs; set total_train_steps"),
    Group("gconfig.*", "laden's generation reads gconfig.n_samples, max_new_tokens, min_new_tokens, temperature, "
           "top_p, top_k, greedy, stop, stop_token_ids and ignore_eos only", _rl),
    Group("actor.megatron", "laden has no Megatron-Core: megatron: allocation modes run on laden's archon engine "
           "(PyTorch's pipeline schedules, FSDP2 and tensor parallel within a stage, expert parallel) with their d, p, t "
           "and e; Megatron's "
           "own settings do not apply"),
    Group("actor.archon.*", "laden's archon engine reads actor.archon.pp_schedule and pp_layers_per_stage; it cuts "
           "stages by parameter bytes plus kept activations (not by layer counts), recomputes whole decoder layers "
           "with actor.gradient_checkpointing, routes experts in the compute dtype, and has no compile or fp8"),
    Group("actor.fsdp.*", "laden's fsdp engine chooses its own wrapping and sharding"),
    Group("actor.mb_spec.*", "laden splits a batch into the fewest micro-batches of at most "
           "actor.mb_spec.max_tokens_per_mb tokens (at least actor.mb_spec.n_mbs), without grouping or rounding"),
    Group("actor.optimizer.*", "laden does not scale the loss (it has no fp16 loss scaler)"),
    Group("actor.pad_to_maximum actor.grad_reduce_dtype actor.use_kernels actor.ds_auto_tp "
           "actor.init_critic_from_actor", "laden's engines pack micro-batches without padding, reduce gradients "
           "in their own precision and pick attention kernels by actor.attn_impl"),
    Group("teacher.backend teacher.allocation_mode teacher.rollout teacher.fsdp teacher.archon teacher.megatron "
           "teacher.attn_impl teacher.use_kernels teacher.pad_to_maximum teacher.gradient_checkpointing",
           "laden's teacher runs on the actor's engine, layout and attention kernel (actor.backend, actor.attn_impl), "
           "in the actor's processes, as its reference model does (not on an inference server or GPUs of its own)",
           _rl),
    Group("teacher.mb_spec", "laden scores the teacher on the actor's micro-batches (actor.mb_spec)", _rl),
    Group("teacher.offload", "laden keeps the teacher loaded between steps (on the roundpipe engine in host "
           "memory, as the policy)", _rl),
    Group("teacher.*", "the teacher only scores the completions, it is never trained: laden reads teacher.path, "
           "init_from_scratch, dtype, temperature, rl_loss_weight and distill_loss_weight", _rl),
)  # fmt: skip
"""First match wins, top-down: a section's pattern takes its whole subtree."""


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    """An AReaL key that repeats another one (`rollout.experiment_name: ${experiment_name}`)."""

    pattern: str
    source: str
    when: Callable[[Run], bool] = _always


COPIES: tuple[Copy, ...] = (
    Copy("*.experiment_name", "experiment_name"),
    Copy("*.trial_name", "trial_name"),
    Copy("*.fileroot", "cluster.fileroot"),
    Copy("tokenizer_path", "actor.path"),
    Copy("rollout.tokenizer_path", "actor.path", lambda run: run.rl),
    Copy("rollout.consumer_batch_size", "train_dataset.batch_size", lambda run: run.rl),
    Copy("actor.max_new_tokens", "gconfig.max_new_tokens", lambda run: run.rl),
    Copy("rollout.use_lora", "actor.use_lora", lambda run: run.rl),
    *(
        Copy(f"{section}.{key}", source, _serves(section))
        for section, key, source in (
            ("sglang", "model_path", "actor.path"),
            ("sglang", "random_seed", "seed"),
            ("sglang", "dtype", "actor.dtype"),
            ("vllm", "model", "actor.path"),
            ("vllm", "seed", "seed"),
            ("vllm", "dtype", "actor.dtype"),
        )
    ),
    Copy("ref.path", "actor.path", lambda run: (run.rl and run.kl) or run.pairs == "dpo"),
)

MAPPED = (
    "allocation_mode", "async_training", "saver.freq_steps", "recover.mode", "actor.init_from_scratch",
    "actor.disable_dropout", "actor.rejection_sampling", "actor.behave_imp_weight_cap",
    "actor.behave_imp_weight_mode", "actor.is_critic", "critic.is_critic", "critic.init_from_scratch",
    "critic.disable_dropout", "teacher.engine_type", "teacher.train", "teacher.init_from_scratch",
    "teacher.disable_dropout",
)  # fmt: skip
"""AReaL keys whose values land in laden's fields (or are checked against the model)."""

_TREE = (
    "tree training (one token trie per batch, each shared prefix computed once under a tree attention mask) is "
    "not implemented; remove it. laden packs every trajectory as a sequence of its own, so a prefix several "
    "sequences share is computed once per sequence (laden.rl.batches.repeated_prefix_tokens counts it): a "
    "group's prompt n_samples times, and with export_style: individual every earlier turn of an agent's "
    "conversation once per later call. export_style: concat (rollout.agent.export_style) trains one sequence "
    "per conversation, on the model's turns, so within a conversation nothing is computed twice; what is "
    "left is the group's prompt, (n_samples - 1) x its tokens per group (e.g. 8 conversations of a 2000-token "
    "prompt and 5 calls of 200 tokens with 300-token tool outputs: 128000 tokens individual, 33600 concat, "
    "19600 as a tree)"
)

UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("actor.enable_tree_training", bool, _TREE),
    ("critic.use_lora", bool, "LoRA on the critic is not implemented: laden trains all of the value model's weights; "
     "remove critic.use_lora"),
    ("critic.enable_tree_training", bool, _TREE),
    ("econfig", lambda v: v is not None, "the tau2-bench environment of AReaL's examples/tau2 agent, which needs the "
     "tau2-bench package (its module tau2) and AReaL's own code (examples/tau2/agent.py, on the areal package); laden "
     "has no tau2 agent: remove econfig and set workflow to an agent class of your own that builds the environment "
     "(docs/agents.md)"),
    ("tir", lambda v: v is not None, "the settings of AReaL's tool-integrated-reasoning workflow "
     "(examples/tir/tir_workflow.py), written against AReaL's engine API (the areal package); laden runs agents "
     "through its OpenAI-compatible endpoint instead: remove the tir section and set workflow to an agent class "
     "(docs/agents.md), its settings in agent_run_args"),
    ("rollout.agent.mode", lambda v: v == "online", "online mode (sessions of external users through AReaL's proxy "
     "gateway) is not implemented; laden runs the agent that workflow names, rollout.agent.mode inline or subproc"),
    ("judge_engine", lambda v: v is not None, "a second model served as an LLM judge (AReaL's tongyi_deepresearch "
     "example) is not implemented; remove judge_engine and score with reward_fn"),
)  # fmt: skip
"""AReaL settings laden cannot honour: (key, whether the value asks for the feature, the error)."""

Role = Literal["laden", "mapped", "unsupported", "copy", "ignored"]


def key_role(dotted: str, laden_keys: tuple[str, ...]) -> Role | None:
    """How laden treats an AReaL key (e.g. `saver.freq_steps`), as `from_areal` does; None if not AReaL's.

    The outermost section that is not laden's decides (`stats_logger.wandb.mode` goes with `stats_logger`).
    """
    if areal_node(dotted) is MISSING:
        return None
    parts = dotted.split(".")
    prefixes = [".".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
    if any(p in MAPPED for p in prefixes):  # mapped and refused keys are taken out first
        return "mapped"
    if any(p == key for p in prefixes for key, _, _ in UNSUPPORTED):
        return "unsupported"
    for prefix in prefixes:
        if prefix in laden_keys:
            if prefix == dotted:
                return "laden"
            continue
        if any(fnmatch.fnmatchcase(prefix, c.pattern) for c in COPIES):
            return "copy"
        return "ignored" if group_of(prefix) is not None else None
    return None


def areal_leaf_keys(tree: KeyTree = AREAL_KEYS, prefix: str = "") -> Iterator[str]:
    """Every dotted key of `AREAL_KEYS` that holds a value (not a section)."""
    for name, sub in tree.items():
        if isinstance(sub, dict):
            yield from areal_leaf_keys(sub, f"{prefix}{name}.")
        else:
            yield prefix + name


def group_of(dotted: str) -> Group | None:
    return next((g for g in GROUPS if any(fnmatch.fnmatchcase(dotted, p) for p in g.patterns.split())), None)


def areal_node(dotted: str) -> Any:
    """The node of `AREAL_KEYS` at `dotted`, or `MISSING`."""
    return get_dotted(AREAL_KEYS, dotted, MISSING)
