"""`auto` knob values, chosen from the planner's predictions before anything is built.

`resolve_auto(cfg, budget)` replaces every `auto` in `cfg` with a value and returns one log line
per choice: the value and the predicted peaks it was chosen from. The budget is this rank's
memory for training: the GPU's share this process may use on a CUDA device
(`process_gpu_bytes`), the host's on the CPU (where the engines' tensors live in host memory).
A prediction may use `HEADROOM` of it. Resolved once per run, before the config is written to
the run directory, so `config.yaml` records what ran. Each choice is the fastest the planner
expects to fit:

- `actor.gradient_checkpointing`: off when the fsdp step is predicted to fit without recompute
  (at the longest sequence when the token budget is `auto` too), on otherwise; off under
  roundpipe (its stages recompute by design).
- `actor.mb_spec.max_tokens_per_mb`: the largest whole number of longest sequences, up to a
  step's batch, whose training peak fits (fewer, fuller micro-batches; never below one longest
  sequence: below it the packer would have to cut sequences).
- `actor.roundpipe.model_memory_limit`: the largest limit whose stage plan's predicted peak fits
  (larger stages: fewer uploads, more layers trained without recompute).
- `actor.roundpipe.recompute_grain`: `stage` (recomputes once per stage) when its peak fits,
  else `layer` (keeps one layer's activations).
- `actor.roundpipe.num_microbatch`: the count the step's batch packs into at the token budget
  (no forced split; each micro-batch's inputs are parked on the host, so the host peak is checked).
- `native.mem_fraction_static`: 0.9 when the engine has the GPU to itself while it generates
  (a GPU of its own, or colocated and asleep during training); colocated and generating while
  training (`max_head_offpolicyness` > 0), what the training peak leaves.
- `rollout.max_concurrent_rollouts`: the sequences the KV cache holds at full length, at most the
  requests a step can have in flight (`batch_size x n_samples x (1 + max_head_offpolicyness)`).
- `actor.weight_chunked_mem_mb`: the largest bucket of 1024, 512, ..., 64 MB whose two copies
  (sender and receiver) fit beside the larger of the training and generation peaks.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from laden.memory.companions import Companions, training_phase
from laden.memory.estimate import (
    GIB,
    ModelShapes,
    host_memory_bytes,
    longest_sequence,
    native_generation,
    no_estimator,
    patched_meta_model,
    sequences_per_sample,
)
from laden.rollout.backend import resolve_rollout

HEADROOM = 0.9
"""The share of the budget a prediction may use (the allocator's slack, the runtime, other processes)."""


def process_gpu_bytes(device: torch.device) -> int:
    """The bytes of `device` this process may allocate: its total, times the fraction set with
    `torch.cuda.set_per_process_memory_fraction` where torch reports one."""
    total = torch.cuda.get_device_properties(device).total_memory
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return int(total * (get(device) if get is not None else 1.0))


def training_budget(device: torch.device) -> int:
    """This rank's memory for training: the GPU's (`process_gpu_bytes`), or the host's physical memory
    on the CPU (0 where the OS does not say: every `auto` then takes its memory-saving value)."""
    if device.type == "cuda":
        return process_gpu_bytes(device)
    return host_memory_bytes() or 0


def resolve_auto(
    cfg: Any, budget: int, *, host_budget: int | None = None, for_gpu: bool | None = None
) -> list[str]:
    """Set every `auto` knob of `cfg` (in place); one line per choice (see the module docstring).

    `for_gpu`: whether `budget` is a GPU's (the engines' CUDA sizing: the KV cache from
    `mem_fraction_static`, roundpipe's limit from the GPU); default: whether this machine has one.
    """
    from laden.engine.backend import resolve_backend

    wanted = set(cfg.auto)
    lines: list[str] = []
    backend = resolve_backend(cfg)
    if cfg.actor.gradient_checkpointing == "auto" and backend.recomputes_by_design:
        cfg.actor.gradient_checkpointing = False  # decided without the model's shapes
        lines.append(f"actor.gradient_checkpointing=auto -> false: {cfg.actor.backend} recomputes by design")
    if cfg.actor.gradient_checkpointing != "auto" and not wanted:
        return lines
    if backend.training_estimator() is None:  # as `laden plan` says of it: one answer for both
        return lines + _fallbacks(cfg, wanted, no_estimator(backend.name))
    host = host_budget if host_budget is not None else host_memory_bytes() or 0
    try:
        model = patched_meta_model(cfg)
        shapes = ModelShapes.from_model(model)
    except (OSError, ValueError) as err:  # a .gguf file, or no config.json: nothing to plan from
        return lines + _fallbacks(cfg, wanted, f"no shapes to plan from ({err})")
    auto = _Resolver(
        cfg, backend, model, shapes, budget, host, torch.cuda.is_available() if for_gpu is None else for_gpu
    )
    if cfg.actor.gradient_checkpointing == "auto":
        lines.append(auto.gradient_checkpointing("actor.mb_spec.max_tokens_per_mb" in wanted))
    for knob, choose in (
        ("actor.roundpipe.model_memory_limit", auto.model_memory_limit),
        ("actor.roundpipe.recompute_grain", auto.recompute_grain),
        ("actor.mb_spec.max_tokens_per_mb", auto.max_tokens_per_mb),
        ("actor.roundpipe.num_microbatch", auto.num_microbatch),
        ("native.mem_fraction_static", auto.mem_fraction_static),
        ("rollout.max_concurrent_rollouts", auto.max_concurrent_rollouts),
        ("actor.weight_chunked_mem_mb", auto.weight_chunked_mem_mb),
    ):
        if knob in wanted:
            lines.append(f"{knob}=auto -> {choose()}")
    cfg.auto = []
    return lines


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def _fallbacks(cfg: Any, wanted: set[str], why: str) -> list[str]:
    """Without shapes: each knob's memory-saving value (or its default where memory does not decide)."""
    lines = []
    if cfg.actor.gradient_checkpointing == "auto":
        cfg.actor.gradient_checkpointing = True
        lines.append(f"actor.gradient_checkpointing=auto -> true: {why}")
    if "actor.mb_spec.max_tokens_per_mb" in wanted:
        cfg.actor.mb_spec.max_tokens_per_mb = _longest_sample(cfg)
        lines.append(
            f"actor.mb_spec.max_tokens_per_mb=auto -> {_longest_sample(cfg)} (one longest sample): {why}"
        )
    if "actor.roundpipe.recompute_grain" in wanted:
        cfg.actor.roundpipe.recompute_grain = "layer"
        lines.append(f"actor.roundpipe.recompute_grain=auto -> layer: {why}")
    rest = sorted(wanted - {"actor.mb_spec.max_tokens_per_mb", "actor.roundpipe.recompute_grain"})
    lines += [f"{knob}=auto -> its default: {why}" for knob in rest]
    cfg.auto = []
    return lines


def _batch_sequences(cfg: Any) -> int:
    """Samples one optimizer step trains on (an RL step: every prompt's `n_samples` completions)."""
    n = cfg.train_dataset.batch_size
    return n * cfg.gconfig.n_samples if cfg.train_dataset.type == "rl" else n


def _longest_sample(cfg: Any) -> int:
    """Tokens of the longest sample a micro-batch must hold whole (a pair: its two sides)."""
    return sequences_per_sample(cfg) * longest_sequence(cfg)


class _Resolver:
    """The choices of `resolve_auto`, each from the estimators at the values chosen before it."""

    def __init__(
        self, cfg: Any, backend: Any, model: Any, shapes: ModelShapes, budget: int, host: int, on_gpu: bool
    ) -> None:
        self.cfg, self.model, self.shapes = cfg, model, shapes
        self.limit = int(HEADROOM * budget)
        self.budget, self.host_limit = budget, int(HEADROOM * host) if host else None
        self.on_gpu = on_gpu
        self.gpu_capacity = budget if on_gpu else None
        self.companions = Companions(cfg, cfg.train_dataset.type)
        self.in_process_rollout = cfg.train_dataset.type == "rl" and resolve_rollout(cfg).in_process

    # ---- training
    def training(self) -> Any:
        """The training phase at the knobs' current values, the models beside the policy included."""
        return training_phase(self.cfg, self.model, self.shapes, self.gpu_capacity, self.cfg.train_dataset.type,
                              self.companions)  # fmt: skip

    def _fits(self) -> bool:
        phase = self.training()
        return phase.gpu <= self.limit and (self.host_limit is None or phase.host <= self.host_limit)

    def _against(self) -> str:
        return f"{_size(self.limit)} ({HEADROOM:.0%} of {_size(self.budget)})"

    def gradient_checkpointing(self, token_budget_auto: bool) -> str:
        actor = self.cfg.actor  # fsdp: `resolve_auto` decides the other engines
        given = actor.mb_spec.max_tokens_per_mb
        if token_budget_auto:  # the token budget is chosen next, from at least one longest sequence
            actor.mb_spec.max_tokens_per_mb = _longest_sample(self.cfg)
        peaks = {}
        for on in (False, True):
            actor.gradient_checkpointing = on
            peaks[on] = self.training().gpu
        actor.gradient_checkpointing = peaks[False] > self.limit
        actor.mb_spec.max_tokens_per_mb = given
        return (
            f"actor.gradient_checkpointing=auto -> {str(actor.gradient_checkpointing).lower()}: predicted "
            f"training peak {_size(peaks[False])} without recompute, {_size(peaks[True])} with, "
            f"against {self._against()}"
        )

    def max_tokens_per_mb(self) -> str:
        spec, longest = self.cfg.actor.mb_spec, _longest_sample(self.cfg)
        most = max(1, _batch_sequences(self.cfg))
        lo, hi = 1, most  # the largest k in [1, most] whose k longest sequences fit (peaks grow with k)
        spec.max_tokens_per_mb = longest
        if not self._fits():
            peak = self.training().gpu
            return (
                f"{longest} (one longest sequence; it does not fit: predicted {_size(peak)} against "
                f"{self._against()}; see `laden plan` for the fixes)"
            )
        while lo < hi:
            mid = (lo + hi + 1) // 2
            spec.max_tokens_per_mb = mid * longest
            if self._fits():
                lo = mid
            else:
                hi = mid - 1
        spec.max_tokens_per_mb = lo * longest
        peak = self.training()
        return (
            f"{spec.max_tokens_per_mb} ({lo} longest sequence{'s' if lo > 1 else ''} of {longest} tokens, of "
            f"{most} a step): predicted training peak {_size(peak.gpu)} against {self._against()}"
        )

    def model_memory_limit(self) -> str:
        rp = self.cfg.actor.roundpipe
        lo, hi = self.budget / GIB / 64, self.budget / GIB  # GiB; bisect for the largest limit that fits
        rp.model_memory_limit = lo
        if not self._fits():
            return f"{lo:.3g} GiB (the smallest tried; predicted {_size(self.training().gpu)} against {self._against()})"
        for _ in range(16):
            mid = (lo + hi) / 2
            rp.model_memory_limit = mid
            if self._fits():
                lo = mid
            else:
                hi = mid
        rp.model_memory_limit = float(f"{lo:.4g}") if float(f"{lo:.4g}") <= lo else lo
        peak = self.training().gpu
        return f"{rp.model_memory_limit:.4g} GiB: predicted training peak {_size(peak)} against {self._against()}"

    def recompute_grain(self) -> str:
        rp = self.cfg.actor.roundpipe
        peaks = {}
        for grain in ("layer", "stage"):
            rp.recompute_grain = grain
            peaks[grain] = self.training().gpu
        rp.recompute_grain = "stage" if peaks["stage"] <= self.limit else "layer"
        return (
            f"{rp.recompute_grain}: predicted training peak {_size(peaks['stage'])} at stage grain, "
            f"{_size(peaks['layer'])} at layer grain, against {self._against()}"
        )

    def num_microbatch(self) -> str:
        cfg = self.cfg
        tokens = cfg.actor.mb_spec.max_tokens_per_mb or _longest_sample(cfg)
        per_mb = max(1, tokens // _longest_sample(cfg))
        cfg.actor.roundpipe.num_microbatch = max(1, math.ceil(_batch_sequences(cfg) / per_mb))
        host = self.training().host
        verdict = (
            "" if self.host_limit is None or host <= self.host_limit
            else f"; over the host budget of {_size(self.host_limit)}: lower actor.mb_spec.max_tokens_per_mb"
        )  # fmt: skip
        return (
            f"{cfg.actor.roundpipe.num_microbatch} (the step's {_batch_sequences(cfg)} sequences at {per_mb} a "
            f"micro-batch): predicted host peak {_size(host)}{verdict}"
        )

    # ---- generation and weight update
    def _colocated(self) -> bool:
        return self.cfg.cluster.n_gpus_per_node < 2

    def mem_fraction_static(self) -> str:
        cfg = self.cfg
        if not self._colocated():
            cfg.native.mem_fraction_static = 0.9
            return "0.9: the rollout engine has a GPU of its own"
        if cfg.rollout.max_head_offpolicyness == 0:
            cfg.native.mem_fraction_static = 0.9
            return "0.9: colocated and synchronous, the engine frees its KV cache while the trainer trains"
        train = self.training()
        resident = train.resident_gpu
        share = HEADROOM - (train.gpu - resident) / self.budget
        cfg.native.mem_fraction_static = round(min(0.9, max(0.05, share)), 3)
        return (
            f"{cfg.native.mem_fraction_static}: generating while training on one GPU, the training peak "
            f"({_size(train.gpu)}, {_size(resident)} of it resident anyway) must fit beside the cache"
        )

    def _generation(self) -> Any:
        return native_generation(self.cfg, self.shapes, self.training(), self.budget if self.on_gpu else None)

    def max_concurrent_rollouts(self) -> str:
        from laden.rollout.native.kv_cache import KVCache

        cfg = self.cfg
        inflight = _batch_sequences(cfg) * (1 + cfg.rollout.max_head_offpolicyness)
        if not self.on_gpu or not resolve_rollout(cfg).in_process:
            cfg.rollout.max_concurrent_rollouts = inflight
            return f"{inflight}: the requests a step can have in flight (the KV cache is sized for them)"
        cfg.rollout.max_concurrent_rollouts = inflight
        cache = next(c.gpu for c in self._generation().components if c.name.startswith("KV cache"))
        per_block = KVCache.bytes_per_block(
            num_layers=self.shapes.num_layers, block_size=32, kv_heads=self.shapes.num_kv_heads,
            head_dim=self.shapes.head_dim, dtype=torch.bfloat16 if cfg.actor.dtype == "bfloat16" else torch.float32,
        )  # fmt: skip
        fit = cache // per_block // (math.ceil(longest_sequence(cfg) / 32) + 1)
        cfg.rollout.max_concurrent_rollouts = max(1, min(inflight, fit))
        if fit < 1:
            return (
                f"1: the KV cache ({_size(cache)}) holds no whole sequence of {longest_sequence(cfg)} tokens; the engine "
                "will refuse to start: raise native.mem_fraction_static or shorten the context (see laden plan)"
            )
        return (
            f"{cfg.rollout.max_concurrent_rollouts}: the KV cache ({_size(cache)}) holds {fit} sequences "
            f"of {longest_sequence(cfg)} tokens, and a step has at most {inflight} requests in flight"
        )

    def weight_chunked_mem_mb(self) -> str:
        cfg = self.cfg
        peaks = [self.training().gpu]
        if self.in_process_rollout and self.on_gpu:
            peaks.append(self._generation().gpu)
        room = self.limit - max(peaks)
        size = next((mb for mb in (1024, 512, 256, 128) if 2 * mb * 2**20 <= room), 64)
        cfg.actor.weight_chunked_mem_mb = size
        return (
            f"{size} MB: two buckets beside the larger phase peak ({_size(max(peaks))}) within "
            f"{self._against()}"
        )
