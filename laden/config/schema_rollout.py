"""The generation side of the configuration tree: `rollout` (the engine, its concurrency and asynchrony, servers
started elsewhere), `vllm`, `sglang` and `native` (each engine's own settings)."""

from dataclasses import dataclass, field
from typing import Literal

from laden.config.schema_agent import AgentConfig


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """The generation side of RL."""

    backend: str = "native:d1"
    """Rollout allocation mode `<backend>:<dims>`, e.g. `native:d1` or `sglang:d2t2`."""
    max_concurrent_rollouts: int | None = None
    """Sequences in flight at once in the rollout engine (the main generation-memory knob); the rest queue; None = 256;
    `auto`: what the KV cache holds at full length, at most what a step can have in flight."""
    max_head_offpolicyness: int = 0
    """How many weight versions a rollout may lag behind the trainer; 0 = on-policy."""
    server_urls: list[str] = field(default_factory=list)
    """vLLM / SGLang servers started elsewhere, one per `d` of `rollout.backend` (`http://host:port`, or AReaL's
    `host:port`): laden attaches to them, checks each answers at start-up, and leaves them running; empty =
    `$AREAL_LLM_SERVER_ADDRS` (AReaL's comma-separated list) when set, else laden starts the servers."""
    setup_timeout: float = 900.0
    """Seconds the rollout servers have to answer at start-up (AReaL's name): those laden starts (loading the model),
    and those of `rollout.server_urls` (which may be starting beside the trainer)."""
    server_host: str = "127.0.0.1"
    """Address the servers laden starts listen on: loopback (only this node reaches them; their API has no
    authentication), `0.0.0.0` (every interface) or one of this node's addresses."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The OpenAI-compatible endpoint of agent workflows (`laden.rl.agent`)."""


@dataclass(kw_only=True, slots=True)
class VLLMConfig:
    """Settings passed to each vLLM server laden starts (`rollout.backend: vllm:dN`), as the command-line flag of
    the same name (`max_num_seqs` -> `--max-num-seqs`); None leaves vLLM's default. `--seed` is the run's `seed`;
    servers started elsewhere (`rollout.server_urls`) keep their own settings."""

    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU's memory vLLM takes for weights, activations and KV cache, in (0, 1]."""
    max_model_len: int | None = None
    """Longest prompt + completion a server accepts (its KV cache must hold one such sequence); None = the model's
    own limit."""
    max_num_seqs: int | None = None
    """Sequences a server runs at once (vLLM's own batch cap; the rest wait in its queue); None = vLLM's default."""
    enable_prefix_caching: bool | None = None
    """`true`: reuse the KV cache of shared prefixes (a group's prompt, computed once for its n samples);
    `false`: `--no-enable-prefix-caching`; None = vLLM's default (on). Each weight update resets the cache."""
    enable_chunked_prefill: bool | None = None
    """`true` / `false` (`--no-enable-chunked-prefill`): split long prompts into chunks scheduled beside decoding;
    None = vLLM's default."""
    enforce_eager: bool = False
    """Run the model without CUDA graphs (less memory and start-up time, slower decoding)."""
    block_size: int | None = None
    """Tokens per KV cache block; None = vLLM's default for the attention backend."""
    cpu_offload_gb: float | None = None
    """GiB of each GPU's weights kept in host memory and streamed in at every forward; None = none."""


@dataclass(kw_only=True, slots=True)
class SGLangConfig:
    """Settings passed to each SGLang server laden starts (`rollout.backend: sglang:dN`), as the command-line flag
    of the same name (`max_running_requests` -> `--max-running-requests`); None leaves SGLang's default.
    `--random-seed` is the run's `seed`; servers started elsewhere (`rollout.server_urls`) keep their own
    settings."""

    mem_fraction_static: float = 0.9
    """Fraction of GPU memory SGLang reserves for weights and KV cache, in (0, 1]."""
    context_length: int | None = None
    """Longest prompt + completion a server accepts; None = the model's own limit."""
    max_running_requests: int | None = None
    """Requests a server runs at once (the rest wait in its queue); None = what its KV cache holds."""
    chunked_prefill_size: int | None = None
    """Most prompt tokens prefilled in one chunk, -1 = no chunking; None = SGLang's default for the GPU."""
    max_prefill_tokens: int | None = None
    """Most prompt tokens in one prefill batch; None = SGLang's default."""
    disable_radix_cache: bool = False
    """Turn off the prefix (radix) cache, which otherwise prefills a group's shared prompt once for its n
    samples; each weight update flushes it."""
    attention_backend: str | None = None
    """SGLang's attention kernels, e.g. `fa3`, `flashinfer`, `triton`; None = SGLang's choice for the GPU."""
    enable_metrics: bool = False
    """Serve Prometheus metrics at each server's `/metrics`."""


@dataclass(kw_only=True, slots=True)
class NativeConfig:
    """Settings of the embedded generation engine."""

    mem_fraction_static: float = 0.8
    """Fraction of the GPU's memory (what this process may use: all of it, or its `torch.cuda.set_per_process_memory_fraction` share) the embedded engine reserves for its weights plus KV cache (after a profiling pass at the largest batch), in (0, 1];
    `auto`: 0.9 when the engine has the GPU while it generates, else what the training peak leaves."""
    free_kv_while_training: Literal["auto", "always", "never"] = "auto"
    """Whether the engine frees its KV cache while a synchronous run (`rollout.max_head_offpolicyness: 0`)
    trains on its GPU, and allocates it again (and recaptures its CUDA graphs) after: `always`; `never`;
    `auto`: frees it during the first step, then keeps it when that step's peak plus the cache fits in 90%
    of the GPU (always frees with a roundpipe trainer, whose engine frees its weights too)."""
