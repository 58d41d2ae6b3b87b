"""The configuration tree: one keyword-only dataclass per section.

Names follow the OOM guides laden is built around (`actor.mb_spec.max_tokens_per_mb`,
`sglang.mem_fraction_static`, ...), so a guide's advice applies to laden's YAML as is.
Every field carries a one-line attribute docstring; `laden.config.docs` turns them into
the reference, and a test fails when one is missing. Trade-off: the dataclasses only
hold values; type coercion lives in the loader and cross-field rules in `validate`, so
the tree stays readable as documentation.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from laden.config.schema_agent import AgentFields
from laden.config.schema_rl import RejectionSamplingConfig
from laden.config.schema_rollout import NativeConfig, RolloutConfig, SGLangConfig, VLLMConfig
from laden.config.schema_teacher import TeacherConfig
from laden.config.schema_trackers import (
    StatsLoggerConfig,
)


@dataclass(kw_only=True, slots=True)
class DatasetConfig:
    """A training or validation dataset."""

    path: str = ""
    """A .jsonl/.json/.parquet/.csv file, a directory of them, a `datasets.save_to_disk` directory, or `hf:<name>`
    (`datasets.load_dataset`; `hf:json` etc. read `data_files`). Relative: to the config file's directory when
    written there, else to the working directory; `hf:` names and Hub ids (`org/name`, no such path) as written."""
    split: str = "train"
    """Dataset split to read (for `hf:` names and saved dataset dicts), e.g. `test` or `train[:1000]`."""
    name: str | None = None
    """`hf:` only: the dataset's configuration (`datasets.load_dataset(path, name)`), e.g. `main` for `openai/gsm8k`."""
    revision: str | None = None
    """`hf:` only: the branch, tag or commit of the dataset repository to read; null = its default branch."""
    data_files: list[str] = field(default_factory=list)
    """`hf:` only: the files to read; with a builder of local files (`hf:json`, `hf:csv`, `hf:parquet`) local paths,
    resolved like `path`; with a repository or directory, paths or globs inside it."""
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    """`hf:` only: further keyword arguments of `datasets.load_dataset` (AReaL's name), e.g. `{trust_remote_code: true}`."""
    rename_columns: dict[str, str] = field(default_factory=dict)
    """Column map applied to every row as it is read, `{source: new}`, e.g. `{question: prompt}`; before `transform_fn`."""
    transform_fn: str | None = None
    """Import path `module:function` of a function applied to every row (a dict in, a dict out), after `rename_columns`."""
    type: Literal["sft", "rl", "dpo", "rw"] = "sft"
    """`sft`: prompt + completion (or chat messages) to imitate; `rl`: prompts (+ answers) to roll out; `dpo`, `rw`:
    preference pairs (prompt + chosen + rejected) for `laden dpo` and `laden rw`; the job's name."""
    max_length: int = 1024
    """Longest prompt (+ completion for SFT) in tokens; longer samples follow `length_policy`."""
    length_policy: Literal["filter", "truncate"] = "filter"
    """What to do with samples longer than `max_length`: drop them or cut them."""
    batch_size: int = 8
    """Sequences (prompts for RL) per optimizer step; does not affect peak memory."""
    shuffle: bool = True
    """Shuffle the samples every epoch (seeded by the top-level `seed`)."""
    fail_fast: bool = False
    """The first step trains on the `batch_size` longest samples (prompts for RL), the rest of epoch 0
    in its usual order: a memory budget that cannot hold the longest batch fails at step 1 (or, with
    `oom_policy: auto`, re-splits there), not hours into the run."""
    prompt_key: str = "prompt"
    """Column holding the prompt text."""
    completion_key: str = "completion"
    """Column holding the completion text (SFT)."""
    messages_key: str = "messages"
    """Column holding chat messages; used instead of prompt/completion when present."""
    chosen_key: str = "chosen"
    """Column holding the preferred completion of a preference pair (DPO, reward model)."""
    rejected_key: str = "rejected"
    """Column holding the dispreferred completion of a preference pair (DPO, reward model)."""
    answer_key: str = "answer"
    """Column holding the reference answer passed to the reward function (RL)."""
    on_bad_row: Literal["stop", "skip"] = "stop"
    """A row that cannot be used (not an object, no prompt, a field of the wrong type), found when the data is
    read at start-up: `stop` names its file and line and stops; `skip` leaves it out, counted in the data stats."""


@dataclass(kw_only=True, slots=True)
class GenerationConfig:
    """Sampling settings for rollouts."""

    n_samples: int = 1
    """Completions generated per prompt (the GRPO group size)."""
    max_new_tokens: int = 256
    """Most tokens generated per completion; adds to `max_length` in the micro-batch budget."""
    min_new_tokens: int = 0
    """Fewest tokens generated before a stop token is honoured."""
    temperature: float = 1.0
    """Sampling temperature; must be > 0 unless `greedy` is set."""
    top_p: float = 1.0
    """Nucleus sampling probability mass, in (0, 1]; 1 = off."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 = off."""
    greedy: bool = False
    """Pick the most likely token instead of sampling."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a completion (the tokenizer's EOS always does)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends at the first token whose text completes one of them."""
    ignore_eos: bool = False
    """Generate exactly `max_new_tokens` per completion, ignoring EOS and stop tokens (benchmarks)."""


@dataclass(kw_only=True, slots=True)
class EvaluatorConfig:
    """When a run evaluates on `valid_dataset` (AReaL's `evaluator`): `laden rl` generates for every
    held-out prompt with `eval_gconfig` and scores it with the reward; `laden sft` computes the loss."""

    freq_steps: int | None = None
    """Evaluate every this many steps; None = not by steps."""
    freq_epochs: int | None = 1
    """Evaluate at the end of every this many epochs; None = not by epochs."""
    freq_secs: float | None = None
    """Evaluate when this many seconds of training passed since the last evaluation; None = not by time."""
    eval_before_train: bool = True
    """Evaluate once before the first step (the `step: 0` row of metrics.jsonl), so a run shows where it
    started; AReaL's default is false. Every run also evaluates after its last step."""
    generate: bool = False
    """`laden sft` only: also generate greedily for every `valid_dataset` prompt and log the exact-match share
    as `eval/accuracy`, and 3 completions before -> after training (`laden.sft.generate_eval`; host generation,
    for small models)."""


@dataclass(kw_only=True, slots=True)
class RewardFnConfig:
    """One reward function of several (`reward_fns`), TRL's `reward_funcs` with `reward_weights`."""

    fn: str = ""
    """Import path `module:function` of the reward function."""
    weight: float = 1.0
    """Its weight in the completion's reward (the weighted sum over the functions)."""
    style: Literal["auto", "laden", "areal", "trl", "verl"] = "auto"
    """How it is called (see `reward_fn_style`); `auto` reads its signature."""
    name: str | None = None
    """Its name in metrics.jsonl (`reward/<name>`); None = the function's own name."""


@dataclass(kw_only=True, slots=True)
class MicroBatchSpec:
    """How a batch is split into micro-batches for forward/backward."""

    max_tokens_per_mb: int | None = None
    """Token budget per micro-batch, the main training-memory knob; None = the longer max_length of train_dataset and valid_dataset (twice it for dpo / rw pairs; RL: train_dataset.max_length + max_new_tokens);
    `auto` (the actor's): the largest whole number of longest sequences whose predicted training peak fits (`laden.memory.auto`)."""
    n_mbs: int = 1
    """Minimum number of micro-batches per step."""
    packing_algorithm: Literal["ffd", "kk"] = "ffd"
    """Packing of sequences into micro-batches: first-fit decreasing or Karmarkar-Karp balancing."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Optimizer and learning-rate schedule."""

    type: Literal["adam", "sgd", "adam_bf16"] = "adam"
    """`adam` (AdamW), `sgd` (no state with momentum 0), `adam_bf16` (bf16 states + Kahan summation)."""
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.999
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam denominator epsilon."""
    momentum: float = 0.0
    """SGD momentum; 0 keeps no optimizer state."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warmup."""
    warmup_steps_proportion: float = 0.0
    """Fraction of the total steps spent in linear warmup, in [0, 1)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr` for linear/cosine decay."""
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this value; 0 = off."""


@dataclass(kw_only=True, slots=True)
class FSDPConfig:
    """Knobs of the `fsdp` actor backend."""

    per_layer_optim_step: bool = False
    """Stream optimizer states to the GPU layer by layer for the step instead of stepping on the CPU."""
    optim_step_prefetch_layers: int = 1
    """Layers prefetched ahead during the per-layer optimizer step."""
    offload_params: bool = False
    """Keep parameters, gradients and optimizer states in host memory between uses."""
    memory_efficient_load: bool = False
    """Build the model on CPU, shard it, and broadcast weights from rank 0 (lower GPU peak at load)."""


@dataclass(kw_only=True, slots=True)
class RoundPipeConfig:
    """Knobs of the `roundpipe` actor backend (CPU-resident model, GPUs as a stateless pool)."""

    num_microbatch: int | None = None
    """At least this many micro-batches per step (more = lower GPU peak, more host activations); None = as many as
    the token budget packs; `auto` (the actor's): that count, with the host peak it parks checked."""
    recompute_grain: Literal["stage", "layer"] = "stage"
    """Backward recomputation per stage (faster) or per layer (lower GPU peak); `auto` (the actor's): stage when its predicted peak fits."""
    model_memory_limit: float | None = None
    """GiB of GPU memory the plan may use (stage weights, gradient accumulators, activations; a prefetched
    stage beside the computing one); None = 60% of what this process may allocate on the GPU; `auto` (the actor's): the largest
    limit whose predicted peak fits."""
    pin_model: Literal["alloc", "register", "off"] = "alloc"
    """Pinned host weights: `alloc` (fastest, ~1.5x model in RAM), `register` (~1x), `off` (on demand: frozen weights
    loaded memory-mapped in the compute dtype stay file-backed, so a LoRA model may exceed host memory; slowest)."""
    optim_step: Literal["sync", "async"] = "sync"
    """`sync`: exact step; `async`: one-step-stale update overlapped with the next step."""
    compile: bool = False
    """torch.compile each decoder layer (fused elementwise kernels; attention stays eager)."""


@dataclass(kw_only=True, slots=True)
class ArchonConfig:
    """Knobs of the `archon` actor backend (pipeline stages, FSDP2 within each, experts over `e`)."""

    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe"] = "1F1B"
    """Pipeline schedule: `1F1B` (one micro-batch's activations per stage in flight), `Interleaved1F1B`
    (several looped stages per rank: a smaller bubble, more sends), `GPipe` (all forwards, then all backwards:
    every micro-batch's activations alive at once)."""
    pp_layers_per_stage: int | None = None
    """With `Interleaved1F1B`: decoder layers per virtual stage, which sets the stages per rank
    (ceil(layers / (p * this))); None = 2 stages per rank. Stages are cut by cost (weights plus kept
    activations), so a stage holds about this many layers, not exactly."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-Experts models: weight of the router's load-balancing loss, in Hugging Face's units
    (`router_aux_loss_coef`; laden computes it per layer and averages over the layers); None = the model
    config's; 0 = off."""
    moe_capacity_factor: float | None = None
    """Mixture-of-Experts models: each expert takes at most this factor times its even share of a
    micro-batch's token assignments, the rest are dropped (counted in `moe_dropped_fraction`); None = dropless."""


@dataclass(kw_only=True, slots=True)
class NormConfig:
    """Centre and scale per-completion values (AReaL's `NormConfig`); keys left out of a mapping take these defaults (AReaL's: batch level)."""

    mean_level: Literal["batch", "group"] | None = "batch"
    """Subtract the mean of the whole `batch`, of each prompt's `group` of completions, or nothing (null)."""
    mean_leave1out: bool = False
    """Leave-one-out mean: each value's baseline is the mean of the others in its level (RLOO)."""
    std_level: Literal["batch", "group"] | None = "batch"
    """Divide by the standard deviation of the `batch`, of each `group`, or by nothing (null: Dr. GRPO)."""
    std_unbiased: bool = True
    """Bessel's correction of the std (divide by n - 1); a single value then has std 1."""
    eps: float = 1e-5
    """Added to the std before dividing, so a group of equal values gives 0, not NaN."""
    group_size: int = 1
    """AReaL's group size for `group` levels (`${gconfig.n_samples}`); laden groups each prompt's completions, so 1 or `gconfig.n_samples`."""


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    """The trained model and its training engine."""

    path: str = ""
    """Hugging Face model directory (weights, config.json, tokenizer), or a Hub id `org/name`, fetched into the Hugging Face cache when the run starts (`HF_HUB_OFFLINE=1`: the cache only). A relative
    path: to the config file's directory when written there, else to the working directory."""
    revision: str = ""
    """Branch, tag or commit of the Hub model when `path` is a Hub id; '' = main."""
    init_from_config: bool = False
    """Initialise weights randomly from `path`/config.json (seeded) instead of loading them."""
    backend: str = "fsdp:d1"
    """Training allocation mode `<backend>:<dims>`, e.g. `fsdp:d2c2` or `roundpipe:d2`."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Compute dtype of weights and activations."""
    optimizer_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of master weights and optimizer states."""
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute activations in backward instead of keeping them. `auto`: on when the planner
    (`laden plan`) predicts that the training step without it does not fit this rank's memory (the
    GPU's, or the host's on the CPU) and with it does; the choice and both peaks are logged."""
    attn_impl: Literal["auto", "varlen", "sdpa", "eager"] = "auto"
    """Attention kernel. `auto`: packed (padding-free) rows; rows of equal-length documents as one SDPA batch (cuDNN on Hopper GPUs), others through the varlen kernel. `varlen`: every packed row through the varlen kernel."""
    chunked_loss: bool = True
    """Compute the LM head + cross-entropy in token chunks so full logits never exist."""
    loss_chunk_size: int = 1024
    """Tokens per chunk of the chunked linear + cross-entropy (a [chunk, vocab] fp32 buffer each)."""
    lean_activations: bool = True
    """RMSNorms and gated MLPs keep for backward only what they cannot recompute elementwise (their
    input and rstd; gate and up): same outputs and gradients as Hugging Face's modules, about 45% less
    activation memory per decoder layer, so more layers train without recompute; False = as is."""
    fused_elementwise: bool | None = None
    """Run the lean RMSNorms' and SwiGLU MLPs' elementwise math and the attention layers' rotary
    embeddings as torch.compile'd fused kernels (only that math, not the layers); equal to the eager ops
    up to float rounding; needs lean_activations. null = on when a CUDA GPU is present (with
    lean_activations), off on the CPU; a kernel that fails to compile runs eager, with a warning."""
    tiled_mlp_tokens: int | None = None
    """Long-context memory: run each decoder MLP over sequence tiles of this many tokens (recomputed in
    backward) and let RMSNorms keep their input, not fp32 copies, for backward; None = off."""
    use_lora: bool = False
    """Train LoRA adapters (peft; `pip install 'laden[lora]'`) instead of the weights: only the adapters get gradients and optimizer states, the frozen base stays in `dtype`; weight updates and the export carry the merged weights."""
    lora_rank: int = 32
    """Rank r of each adapter pair, with `use_lora` (AReaL's default)."""
    lora_alpha: float = 16.0
    """Adapter scale numerator: each projection becomes W + (lora_alpha / lora_rank) * B A, with `use_lora` (AReaL's default)."""
    target_modules: list[str] = field(default_factory=list)
    """Linear layers to adapt with `use_lora`, by name (e.g. [q_proj, v_proj]); [] or [all-linear] = every linear layer but the output head."""
    peft_type: str = "lora"
    """The parameter-efficient method of `use_lora`; only `lora` is implemented."""
    lora_path: str | None = None
    """A peft adapter directory (`adapter_config.json` + `adapter_model.safetensors`, e.g. a laden export's `hf/adapter/`) whose weights the adapters start from, with `use_lora`: continues training it (its rank must equal `lora_rank`, and `lora_alpha` its alpha); None = fresh adapters (B = 0)."""
    weight_update_mode: Literal["xccl", "disk"] = "xccl"
    """How new weights reach the rollout engine: `xccl` (the native engine: copied in place; SGLang servers: broadcast from the trainer, NCCL or gloo on the CPU; vLLM servers refuse it) or `disk` (versioned directories under `cluster.fileroot`, every engine)."""
    weight_chunked_mem_mb: int = 1024
    """MiB per bucket of the chunked NCCL weight update (and per shard of a disk update); `auto`: the largest of
    1024, 512, ..., 64 whose two copies fit beside the larger phase peak."""
    group_size: int = 1
    """Completions per prompt that form a GRPO group (AReaL's `${gconfig.n_samples}`); laden's groups come from `gconfig.n_samples`, so 1 or that value."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per RL step: the batch's prompt groups are split into this many minibatches (AReaL's default is 4)."""
    eps_clip: float = 0.2
    """PPO clip: the importance ratio is clipped to `[1 - eps_clip, 1 + eps_clip_higher]`; in (0, 1), or [0, 1) with `m2_threshold`."""
    eps_clip_higher: float | None = None
    """Upper clip of the ratio (DAPO's clip-higher, e.g. 0.28); null = `eps_clip`."""
    c_clip: float | None = None
    """Dual clip: the loss of a token with a negative advantage A is at most `c_clip * |A|`; > 1, null = off."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """`token`: one importance ratio per token (PPO); `sequence`: the sequence's geometric-mean ratio (GSPO); needs c=1."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """Loss average: every loss token counts once (`token-mean`), or every sequence does, as its tokens' mean (needs c=1)."""
    temperature: float = 1.0
    """Logits are divided by it when the trainer computes log-probs; set it to `gconfig.temperature` (AReaL writes `${gconfig.temperature}`)."""
    reward_scaling: float = 1.0
    """Reward shaping: each reward becomes `(reward + reward_bias) * reward_scaling`, clipped to +-`reward_clip`."""
    reward_bias: float = 0.0
    """Added to each reward before `reward_scaling`."""
    reward_clip: float = 20.0
    """Largest absolute shaped reward; larger ones are clipped to it."""
    overlong_reward_penalty: bool = False
    """DAPO's soft overlong penalty, added to the reward: 0 up to `gconfig.max_new_tokens - overlong_tokens` generated tokens, then linear down to `-overlong_penalty_factor` at `gconfig.max_new_tokens`."""
    overlong_tokens: int | None = None
    """Tokens in the penalised tail of the generation budget; required by `overlong_reward_penalty`."""
    overlong_penalty_factor: float | None = None
    """Penalty at `gconfig.max_new_tokens` generated tokens; required by `overlong_reward_penalty`."""
    mask_no_eos_with_zero: bool = False
    """Truncated completions (no EOS) get advantage 0 before `adv_norm`."""
    discount: float = 1.0
    """Discount of future rewards per token (GAE's gamma), in [0, 1]; read with a `critic` only (without one every token's return is its completion's reward)."""
    gae_lambda: float = 1.0
    """GAE's lambda, in [0, 1]: 1 = Monte Carlo returns minus the critic's value, 0 = one-step TD errors; read with a `critic` only."""
    beta: float = 0.1
    """`laden dpo`: strength of the implicit KL constraint to the reference model (the initial weights); > 0."""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """`laden dpo`: `sigmoid` is DPO's loss, `ipo` IPO's squared loss on length-normalised log-ratios."""
    kl_ctl: float = 0.0
    """Coefficient of a per-token KL(pi || pi_ref) loss term; 0 = off, no reference model (AReaL's default is 0.1)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimate per token with r = pi / pi_ref: `k1` log r, `k2` (log r)^2 / 2, `k3` 1/r - 1 + log r."""
    recompute_logprob: bool = False
    """The trainer recomputes the completions' log-probs before the update and takes the ratio against them instead of the rollout engine's."""
    use_decoupled_loss: bool = False
    """Decoupled PPO (asynchronous RL): the ratio against the proximal policy's log-probs (recomputed), times a behaviour weight (`rejection_sampling`, `apply_behav_imp_weight`); implies `recompute_logprob`."""
    rejection_sampling: RejectionSamplingConfig | None = None
    """With `use_decoupled_loss`: AReaL 1.0.4's rejection sampling of stale tokens, whose behaviour weight the loss then takes; null = off."""
    apply_behav_imp_weight: bool = True
    """With `use_decoupled_loss` and no `rejection_sampling`: weight every token's loss by pi_prox / pi_behav (before AReaL 1.0.4); false: no behaviour weight (AReaL 1.0.4)."""
    behav_imp_weight_cap: float | None = None
    """With `use_decoupled_loss`, before-1.0.4 semantics: tokens whose behaviour weight pi_prox / pi_behav exceeds this (> 1) get weight 0; null = off."""
    prox_logp_method: Literal["recompute", "loglinear", "metrics"] = "recompute"
    """With `use_decoupled_loss`: pi_prox `recompute`d by a forward pass, `loglinear` approximated from the behaviour and current log-probs and versions (no forward pass), or recomputed with the approximations' errors logged (`metrics`)."""
    m2_threshold: float | None = None
    """M2PO, with `use_decoupled_loss`: per micro-batch the tokens of largest (log pi_behav - log pi_prox)^2 leave the loss until the rest's mean is below it (> 0); null = off."""
    use_sapo_loss: bool = False
    """SAPO: soft sigmoid gates of the ratio instead of the clip (not with `use_decoupled_loss`)."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for positive advantages (> 0)."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for negative advantages (> 0)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (no gradient) are dropped and the batch refilled from the next prompts."""
    mb_spec: MicroBatchSpec = field(default_factory=MicroBatchSpec)
    """Micro-batching of forward/backward."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """Knobs of the `fsdp` backend."""
    roundpipe: RoundPipeConfig = field(default_factory=RoundPipeConfig)
    """Knobs of the `roundpipe` backend."""
    archon: ArchonConfig = field(default_factory=ArchonConfig)
    """Knobs of the `archon` backend (and of `megatron:` allocations, which run on it)."""
    reward_norm: NormConfig | None = None
    """Normalisation of the shaped rewards (e.g. group mean and std); null = rewards as they are."""
    adv_norm: NormConfig | None = field(
        default_factory=lambda: NormConfig(mean_level="group", std_level="group")
    )
    """Normalisation of the advantages, token-weighted; default group mean and std (GRPO); a mapping given here starts from `NormConfig`'s batch defaults; null = off."""


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """PPO's value model (AReaL's `critic`): the actor's architecture with a one-output head, trained with the clipped value loss; its values give GAE advantages (`actor.discount`, `actor.gae_lambda`), normalised by `actor.adv_norm` over tokens. Unset fields follow the actor's; attention kernel and model patches always do."""

    path: str = ""
    """Hugging Face model directory (or Hub id `org/name`) whose decoder the critic starts from (the value head starts at zero); '' = `actor.path`;
    relative paths as `actor.path`'s."""
    revision: str = ""
    """Branch, tag or commit of the Hub model when `path` is a Hub id; '' = main."""
    init_from_config: bool | None = None
    """Initialise the decoder randomly from `path`/config.json (seeded) instead of loading its weights; null = `actor.init_from_config`."""
    backend: str = ""
    """Training allocation `<backend>:<dims>` (fsdp, roundpipe, archon or megatron), in the actor's processes: the same number of processes, d, t and c; '' = `actor.backend`."""
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    """Compute dtype of weights and activations; null = `actor.dtype`."""
    optimizer_dtype: Literal["float32", "bfloat16"] | None = None
    """Storage dtype of master weights and optimizer states; null = `actor.optimizer_dtype`."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in backward instead of keeping them; null = `actor.gradient_checkpointing`."""
    ppo_n_minibatches: int = 1
    """Critic optimizer steps per RL step: the batch's prompt groups are split into this many minibatches (AReaL's default is 4)."""
    eps_clip: float = 0.5
    """Value clip: a token's loss is the larger of (v - R)^2 / 2 and that of v clipped to within eps_clip of its value before the step; > 0 (AReaL's default)."""
    mask_no_eos_with_zero: bool = False
    """Truncated completions (no EOS) leave the value loss (their values are still used for GAE)."""
    mb_spec: MicroBatchSpec | None = None
    """Micro-batching of the critic's forward/backward; null = `actor.mb_spec`."""
    optimizer: OptimizerConfig | None = None
    """Optimizer and learning-rate schedule; null = `actor.optimizer`; a mapping given here starts from `OptimizerConfig`'s defaults."""
    fsdp: FSDPConfig | None = None
    """Knobs of the `fsdp` backend; null = `actor.fsdp`."""
    roundpipe: RoundPipeConfig | None = None
    """Knobs of the `roundpipe` backend; null = `actor.roundpipe`."""
    archon: ArchonConfig | None = None
    """Knobs of the `archon` backend (and `megatron:` modes); null = `actor.archon`."""


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Where the run executes and writes."""

    fileroot: str = "runs"
    """Root directory of run outputs (must be shared across nodes for disk weight updates). Relative: to the config
    file's directory when written there, else (the default `runs` too) to the working directory."""
    n_nodes: int = 1
    """Number of nodes."""
    n_gpus_per_node: int = 1
    """GPUs per node; 0 = the CPU: every process trains and generates on the CPU (gloo), even where CUDA is visible."""

    @property
    def on_cpu(self) -> bool:
        """Whether the run is on the CPU (`n_gpus_per_node: 0`, AReaL's CPU examples)."""
        return self.n_gpus_per_node == 0


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Saving and resuming."""

    save_freq_steps: int | None = None
    """Save a checkpoint every this many optimizer steps; None = only at the end."""
    keep_last: int = 2
    """Checkpoints kept in the run directory; older ones are deleted."""
    save_at_end: bool = True
    """Write a checkpoint after the last step; false for runs whose training state would not fit on the
    disk (a systems benchmark): the run then resumes from its last `save_freq_steps` checkpoint."""
    resume: Literal["auto", "never"] = "auto"
    """`auto`: resume from the newest checkpoint in the run directory; `never`: start fresh."""
    export_hf: bool = True
    """Export a Hugging Face model directory at the end of training, to `hf/` in the run directory (`save_pretrained`'s layout; a LoRA run's adapters in `hf/adapter/`)."""
    export_hf_freq_steps: int | None = None
    """Also export every this many optimizer steps, to `hf_steps/step_N/` in the run directory, each kept (like Hugging Face Trainer's `checkpoint-N/`: a model's size on disk each); `laden export RUN_DIR --step N` writes the same from a checkpoint later. None = only the final export."""
    save_every_minutes: float | None = 30.0
    """Also write a checkpoint when this many minutes passed since the last one (a kill loses at most that
    much); None = only every `save_freq_steps` and at the end."""
    on_damage: Literal["previous", "stop"] = "previous"
    """A newest checkpoint whose files fail their checksums or cannot be read: `previous` resumes from the
    newest intact one (saying which file was damaged), `stop` stops and names the file."""


AUTO_KNOBS = (
    "actor.mb_spec.max_tokens_per_mb",
    "actor.roundpipe.num_microbatch",
    "actor.roundpipe.recompute_grain",
    "actor.roundpipe.model_memory_limit",
    "rollout.max_concurrent_rollouts",
    "native.mem_fraction_static",
    "actor.weight_chunked_mem_mb",
)
"""The fields that take the value `auto` besides `actor.gradient_checkpointing` (`LadenConfig.auto`)."""


@dataclass(kw_only=True, slots=True)
class LadenConfig(AgentFields):
    """The whole run (the agent workflows' top-level fields are `AgentFields`'s)."""

    experiment_name: str = "laden"
    """Experiment name; the run directory is `cluster.fileroot/experiment_name/trial_name`."""
    trial_name: str = "run0"
    """Trial name within the experiment."""
    seed: int = 1
    """Random seed for data order, initialisation and sampling."""
    total_train_epochs: int = 1
    """Passes over the training dataset."""
    total_train_steps: int | None = None
    """Stop after this many optimizer steps; None = run all epochs."""
    max_concurrent_rollouts: int | None = None
    """Alias of `rollout.max_concurrent_rollouts` (as the OOM guide writes it); setting both differently is an error."""
    auto: list[str] = field(default_factory=list)
    """Knobs the planner chooses at start-up (dotted names, from `AUTO_KNOBS`), for this run's memory: writing
    `auto` as one of their values (`actor.mb_spec.max_tokens_per_mb: auto`) lists it here. Each is resolved
    before anything is built, logged with its predicted peaks, and `config.yaml` records the chosen value."""
    oom_policy: Literal["raise", "auto"] = "raise"
    """On an out-of-memory error: report the knob to change (and stop; a rerun resumes), or `auto`:
    re-split the training step and retry it with the same samples (the token budget halved down to one
    longest sequence; in `laden rl` the same documents in smaller micro-batches; then layer recompute),
    and make a `laden rl` in-place weight update again through disk. The native engine's generation
    lowers its concurrency and re-queues under either policy (reported when one sequence cannot fit)."""
    log_freq_steps: int = 1
    """Log metrics every this many optimizer steps."""
    reward_fn: str = "laden.rl.rewards:math_reward"
    """Import path `module:function` of the reward function that scores each completion in `laden rl`."""
    workflow: str = "laden.rl.workflow:RLVRWorkflow"
    """Import path `module:Class` of the rollout workflow that turns a prompt into scored completions (AReaL's RLVR by default),
    or of an agent class (`async def run(self, data, **extra_kwargs)`, AReaL's contract: `laden.rl.agent`)."""
    reward_timeout_s: float = 30.0
    """Seconds one reward call may run before its worker process is killed and replaced; the call scores as a failure."""
    reward_workers: int = 2
    """Processes that score rewards in parallel, outside the training process."""
    reward_fn_style: Literal["auto", "laden", "areal", "trl", "verl"] = "auto"
    """How `reward_fn` is called: `laden` (prompt, completion, prompt_ids, completion_ids, **fields), `areal`
    (the same four positionally, AReaL's), `trl` (TRL's batched `(prompts, completions, completion_ids, **kwargs)
    -> list`), `verl` (`compute_score(data_source, solution_str, ground_truth, extra_info)`); `auto` reads the
    function's parameter names."""
    reward_fns: list[RewardFnConfig] = field(default_factory=list)
    """Several reward functions, each `{fn, weight, style, name}`: a completion's reward is the weighted sum,
    and each is logged as `reward/<name>`; replaces `reward_fn` when set."""
    reward_error_tolerance: float = 0.5
    """The largest share of a step's completions whose reward may fail (raise, time out, return a non-number)
    before the run stops, after a checkpoint of the step before, with the first error."""
    reward_worker_max_calls: int | None = 10000
    """A reward worker process is replaced after this many calls (a reward that leaks memory is bounded);
    None = never."""
    reward_worker_max_rss_gb: float | None = 4.0
    """A reward worker whose resident memory passes this many GiB after a call is replaced; None = no bound."""
    reward_import_timeout_s: float = 120.0
    """Seconds the reward workers may take to import the reward module at start-up before the run stops,
    reporting a module that blocks at import."""
    train_dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """Training data."""
    valid_dataset: DatasetConfig | None = None
    """Held-out data, evaluated as `evaluator` says: `laden rl` generates for its prompts with `eval_gconfig` and
    reports `eval/accuracy`; `laden sft` reports `eval_loss`. None = no evaluation."""
    evaluator: EvaluatorConfig = field(default_factory=EvaluatorConfig)
    """When to evaluate on `valid_dataset`."""
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    """Rollout sampling settings."""
    eval_gconfig: GenerationConfig | None = None
    """Sampling for `laden rl`'s evaluation; None = greedy, one completion per prompt, `gconfig`'s
    `max_new_tokens` and stops (AReaL's None is a copy of `gconfig`). `n_samples: k` with a temperature
    reports `eval/pass@k` too."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained model and its engine."""
    critic: CriticConfig | None = None
    """PPO's value model (`laden rl`); null = no critic: GRPO-style advantages from the rewards alone; `critic: {}` = one on the actor's settings."""
    teacher: TeacherConfig | None = None
    """On-policy distillation from a frozen teacher model (`laden rl`); null = none."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM server settings."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """SGLang server settings."""
    native: NativeConfig = field(default_factory=NativeConfig)
    """Embedded generation engine settings."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Nodes, GPUs and output root."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    stats_logger: StatsLoggerConfig = field(default_factory=StatsLoggerConfig)
    """Experiment trackers (W&B, SwanLab, TensorBoard, Trackio); none by default."""

    @property
    def run_dir(self) -> Path:
        """`cluster.fileroot/experiment_name/trial_name`."""
        return run_dir(self)


def run_dir(cfg: LadenConfig) -> Path:
    """The run directory: `cluster.fileroot/experiment_name/trial_name`."""
    return Path(cfg.cluster.fileroot) / cfg.experiment_name / cfg.trial_name
