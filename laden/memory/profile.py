"""`laden plan --profile`: one step of each phase at its worst case, measured, beside the prediction.

The worst case of each phase is what its knobs allow at most:

- training: the engine `actor.backend` names, built as the job builds it (the same loading,
  patches and optimizer; `laden rw`'s one-row head), with the models `laden rl` keeps beside it
  (the reference model, the teacher, the critic: `laden.profile_steps`), runs one
  optimizer step on micro-batches of the full token budget (`tokens_per_microbatch`), each packed
  with sequences of the longest length the datasets allow (whole pairs for `laden dpo` / `laden
  rw`), `min_micro_batches` of them (the roundpipe engine parks activations per micro-batch), two
  steps (`TRAINING_STEPS`: the second's forward runs with the optimizer's states allocated, as
  every later step does); the loss is the configured cross-entropy, or the pair job's own (an RL
  objective's extra per-token fields are a few bytes a token);
- generation (`laden rl` with the native engine): the engine built beside the trainer as the RL
  trainer builds it (its KV cache then fills what `native.mem_fraction_static` leaves after
  the trainer), then `max_concurrent_rollouts` requests of the longest prompt, each generating
  exactly `gconfig.max_new_tokens` tokens;
- weight update: one update of every weight into that engine (in place, or through a version
  directory for `actor.weight_update_mode: disk`). With rollout servers (vLLM, SGLang) neither
  generation nor the weight update is run: the report names the update as not measured.

Measured per phase: the GPU's allocated peak (`torch.cuda.max_memory_allocated`) over the
phase, process-wide, as the estimators count it (training: from before the model is built;
generation: the trainer's resident bytes included, as `NativeGeneration` counts them; the
weight update: above what is allocated before it, as `WeightUpdate` counts it), the reserved
peak beside it, and the host's resident-set high-water mark (`VmHWM`, reset per phase) above
the resident set when the phase began, which leaves out the interpreter, torch and the CUDA
context. With the engine on the CPU the host holds everything the GPU would, and the plan
counts the process's baseline (`laden.memory.estimate.on_the_cpu`): the host figure is then the
high-water mark itself (the resident set at the phase's start included) for the phases counted
from the process's start (`FROM_PROCESS_START`), and above the phase's start for the weight
update, as on the GPU. One process only: a `dN` layout of several ranks is profiled per rank by a run.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from laden.memory.estimate import FROM_PROCESS_START, GIB, PhaseEstimate
from laden.rollout.backend import resolve_rollout

log = logging.getLogger("laden.profile")

TRAINING_STEPS = 2
"""Optimizer steps the training profile runs: the first allocates the optimizer's states (a first
step's forward runs without them), the second is the steady state every later step repeats."""


@dataclass(slots=True)
class Measured:
    phase: str
    gpu: int | None
    """Allocated peak over the phase (bytes; None without a GPU)."""
    gpu_reserved: int | None
    """The caching allocator's reserved peak (bytes; None without a GPU)."""
    host: int | None
    """Resident-set high-water mark over the phase (None where /proc has none): above the resident set
    at the phase's start, or, for an engine on the CPU in a phase counted from the process's start,
    the mark itself (the process's baseline included, as the plan counts it)."""
    seconds: float
    host_start: int | None = None
    """The resident set when the phase began (bytes)."""

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "gpu": self.gpu, "gpu_reserved": self.gpu_reserved, "host": self.host,
                "host_start": self.host_start, "seconds": round(self.seconds, 3)}  # fmt: skip


class _Phase:
    """Measures one phase: GPU peaks from the allocator, the host's from /proc/self (VmHWM, reset)."""

    def __init__(self, name: str, device: torch.device, *, gpu_from_zero: bool) -> None:
        self.name, self.device, self.gpu_from_zero = name, device, gpu_from_zero
        self.result: Measured | None = None
        # the engine on the CPU: the host holds what the GPU would, counted as `on_the_cpu` counts it
        self.host_from_zero = device.type == "cpu" and name in FROM_PROCESS_START

    def __enter__(self) -> _Phase:
        gc.collect()
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.gpu_base = 0 if self.gpu_from_zero else torch.cuda.memory_allocated(self.device)
        self.host_base = _reset_host_peak()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        gpu = reserved = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            gpu = torch.cuda.max_memory_allocated(self.device) - self.gpu_base
            reserved = torch.cuda.max_memory_reserved(self.device)
        peak = _proc_status("VmHWM")
        # at least 0: the kernel syncs each thread's RSS counters in batches (up to 64 pages a thread),
        # so a phase that keeps nothing can read a few hundred KB below its base
        if peak is None or self.host_base is None:
            host = None
        else:
            host = peak if self.host_from_zero else max(0, peak - self.host_base)
        self.result = Measured(self.name, gpu, reserved, host, time.perf_counter() - self.t0, self.host_base)


def _proc_status(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_host_peak() -> int | None:
    """Reset VmHWM to the current resident set (Linux's clear_refs "5"); that resident set, or None."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _proc_status("VmRSS")


def worst_case_micro_batches(cfg: Any, vocab_size: int, *, seed: int = 0) -> list[Any]:
    """Micro-batches of the full token budget, packed with the longest sequences (random tokens); for
    `laden dpo` / `laden rw` whole pairs of two longest sides (DPO's with reference log-probs)."""
    from laden.data.batch import pack_samples
    from laden.engine.backend import resolve_backend
    from laden.memory.estimate import longest_sequence, sequences_per_sample, tokens_per_microbatch

    tokens = tokens_per_microbatch(cfg)
    per = sequences_per_sample(cfg)
    longest = min(tokens // per, longest_sequence(cfg))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max(1, resolve_backend(cfg).min_micro_batches(cfg))):
        if per == 2:
            out.append(_worst_case_pairs(cfg, vocab_size, tokens // (2 * longest), longest, gen))
            continue
        lengths = [longest] * (tokens // longest) + ([tokens % longest] if tokens % longest > 1 else [])
        samples = [(torch.randint(0, vocab_size, (n,), generator=gen).tolist(), [1] * n) for n in lengths]
        out.append(pack_samples(samples))
    return out


def _worst_case_pairs(cfg: Any, vocab: int, count: int, length: int, gen: torch.Generator) -> Any:
    from laden.align.data import Pair, pack_pairs

    def side() -> Any:
        return torch.randint(0, vocab, (length,), generator=gen).tolist(), [0] + [1] * (length - 1)

    dpo = cfg.train_dataset.type == "dpo"
    pairs = [Pair(side(), side(), ([-1.0] * length, [-1.0] * length) if dpo else None) for _ in range(count)]
    return pack_pairs(pairs, with_ref=dpo)


StepBuilder = Callable[[Any, Any, str], tuple[Any, Callable[[list[Any]], float]]]
"""`(cfg, runtime, job) -> (the policy's engine, one optimizer step of every trained model on given
micro-batches, returning the policy's loss)`: the engines built as `job` builds them
(`laden.profile_steps.training_step`, which the CLI passes: it builds `laden rl`'s and the pair jobs'
models, packages that sit above this one)."""


def profile_phases(cfg: Any, *, job: str, training_step: StepBuilder) -> list[Measured]:
    """Run each phase of `job` once at its worst case in this process and measure it (module docstring)."""
    from laden.engine.backend import resolve_backend
    from laden.engine.device import trim_host_heap
    from laden.engine.runtime import batch_device, seed_everything, start_runtime

    backend = resolve_backend(cfg)
    rt = start_runtime(backend, cpu=cfg.cluster.on_cpu)
    if rt.world_size != 1:
        raise ValueError(
            f"laden plan --profile runs one process, and {rt.world_size} were launched; profile one rank's "
            "share by planning for it without --profile, or run the job itself"
        )
    seed_everything(cfg.seed)
    device = torch.device(rt.device)
    results: list[Measured] = []
    with _Phase("training", device, gpu_from_zero=True) as phase:
        engine, step = training_step(cfg, rt, job)
        vocab = _vocab(cfg)
        mbs = [mb.to(batch_device(backend, rt)) for mb in worst_case_micro_batches(cfg, vocab)]
        for _ in range(TRAINING_STEPS):
            loss = step(mbs)
        del mbs  # `step` keeps the models beside the policy alive through generation, as `laden rl` does
    assert phase.result is not None
    results.append(phase.result)
    log.info(
        "profile: %d training steps done (loss %.3f) in %.1f s", TRAINING_STEPS, loss, phase.result.seconds
    )
    if job == "rl" and resolve_rollout(cfg).in_process:
        if device.type == "cpu":  # as `laden rl` does after each step on the CPU
            trim_host_heap()
        results += _profile_rollout(cfg, engine, device, vocab)
    return results


def _vocab(cfg: Any) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(cfg.actor.path, local_files_only=True).vocab_size)


def _profile_rollout(cfg: Any, trainer: Any, device: torch.device, vocab: int) -> list[Measured]:
    """Generation and one weight update, with the native engine beside the trainer."""
    import asyncio

    from laden.model.dtypes import torch_dtype
    from laden.rollout import GenerationRequest, SamplingParams
    from laden.rollout.factory import max_concurrent_rollouts, native_engine_from_weights

    engine = native_engine_from_weights(
        cfg, trainer.named_weights(), device=device
    )  # as `laden rl` builds it
    results = []
    with _Phase("weight update", device, gpu_from_zero=False) as phase:
        if cfg.actor.weight_update_mode == "disk":
            import tempfile

            from laden.weights import WeightUpdateMeta, write_weights

            with tempfile.TemporaryDirectory(prefix="laden-profile-") as tmp:
                meta = WeightUpdateMeta.from_disk(
                    "profile", "profile", tmp, weight_chunked_mem_mb=cfg.actor.weight_chunked_mem_mb
                )
                assert meta.path is not None
                named = trainer.named_weights(torch_dtype(cfg.actor.dtype), device="cpu")
                write_weights(named, meta.path, 1, shard_mb=cfg.actor.weight_chunked_mem_mb, keep_last=1)
                asyncio.run(engine.update_weights(meta, version=1))
        else:
            asyncio.run(engine.update_weights(trainer.named_weights(), version=1))
    assert phase.result is not None
    results.append(phase.result)
    n = max_concurrent_rollouts(cfg)
    sampling = SamplingParams(max_new_tokens=cfg.gconfig.max_new_tokens, temperature=1.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = cfg.train_dataset.max_length
    requests = [
        GenerationRequest(
            rid=f"p{i}",
            input_ids=tuple(torch.randint(0, vocab, (prompt,), generator=gen).tolist()),
            sampling=sampling,
        )
        for i in range(n)
    ]
    with _Phase("generation", device, gpu_from_zero=True) as phase:
        done = engine.generate_sync(requests)
    assert phase.result is not None and len(done) == n
    results.append(phase.result)
    asyncio.run(engine.close())
    return results


def render_profile(phases: list[PhaseEstimate], measured: list[Measured]) -> str:
    """Predicted next to measured per phase, with the relative error of each side (the host's alone,
    with the resident set at the phase's start, for a plan of the engine on the CPU)."""
    if phases and all(p.on_cpu for p in phases):
        return _render_cpu_profile(phases, measured)
    by_phase = {m.phase: m for m in measured}
    lines = ["profile: predicted vs measured (one step of each phase at its worst case)",
             f"  {'phase':<14} {'GPU pred':>9} {'GPU meas':>9} {'err':>7} {'reserved':>9} "
             f"{'host pred':>9} {'host meas':>9} {'err':>7}"]  # fmt: skip
    for p in phases:
        m = by_phase.get(p.phase)
        if m is None:
            continue
        lines.append(
            f"  {p.phase:<14} {p.gpu / GIB:>9.2f} {_gib(m.gpu)} {_err(p.gpu, m.gpu)} {_gib(m.gpu_reserved)} "
            f"{p.host / GIB:>9.2f} {_gib(m.host)} {_err(p.host, m.host)}"
        )
    lines.append("  (GiB; err = predicted / measured - 1; the host side excludes the process's own baseline)")
    return "\n".join(lines + _unmeasured(phases, by_phase))


def _render_cpu_profile(phases: list[PhaseEstimate], measured: list[Measured]) -> str:
    by_phase = {m.phase: m for m in measured}
    lines = ["profile: predicted vs measured host peak (one step of each phase at its worst case, on the CPU)",
             f"  {'phase':<14} {'at start':>9} {'host pred':>9} {'host meas':>9} {'err':>7}"]  # fmt: skip
    for p in phases:
        m = by_phase.get(p.phase)
        if m is not None:
            lines.append(
                f"  {p.phase:<14} {_gib(m.host_start)} {p.host / GIB:>9.2f} {_gib(m.host)} {_err(p.host, m.host)}"
            )
    lines.append(
        "  (GiB; err = predicted / measured - 1; the process's peak resident set, its baseline included, "
        "except the weight update's: above its start)"
    )
    return "\n".join(lines + _unmeasured(phases, by_phase))


def _unmeasured(phases: list[PhaseEstimate], by_phase: dict[str, Measured]) -> list[str]:
    """A line naming the planned phases a profile did not run: the weight update to rollout servers, which
    a profile does not start (its prediction is the trainer's side alone)."""
    missing = [p.phase for p in phases if p.phase not in by_phase]
    if not missing:
        return []
    return [f"  not measured: {', '.join(missing)} (the rollout engine is servers of their own, not started by a "
            "profile; the plan's figure is the trainer's side)"]  # fmt: skip


def _gib(value: int | None) -> str:
    return f"{'-':>9}" if value is None else f"{value / GIB:>9.2f}"


def _err(predicted: int, measured: int | None) -> str:
    if measured is None or measured <= 0:
        return f"{'-':>7}"
    return f"{(predicted / measured - 1) * 100:>+6.1f}%"


def relative_error(predicted: int, measured: int | None) -> float | None:
    """predicted / measured - 1, or None when nothing was measured."""
    if measured is None or measured <= 0:
        return None
    return predicted / measured - 1
