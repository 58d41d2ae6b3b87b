"""The runtime every trainer stands on: processes, the model, the engine, data parallelism, OOM retry.

A trainer (`laden sft`, `laden rl`) is a loop over steps; everything around the loop that does
not depend on what a step computes lives here, once:

- `start_runtime`: join torchrun's process group when launched by it (NCCL + gloo on GPUs,
  gloo on CPUs), else one plain process; `Runtime` knows the rank, the device, and runs a
  piece of work on rank 0 with its outcome (an error included) shared with every rank;
- `load_model`: the model as the engine's backend object loads it (`laden.engine.backend`; e.g.
  `actor.fsdp.memory_efficient_load`: rank 0 reads the weights, the others build a meta skeleton),
  LoRA adapters (`actor.use_lora`, `laden.model.lora`), the model patches (`laden.model.patches`)
  for the engine that will run it, and the model's head rules;
- `shard_for_rank` / `loss_tokens`: each data-parallel rank's token-balanced share of a global
  batch, and the global normaliser every rank computes from host data;
- `OOMRetry`: the one out-of-memory retry of a training step, with two strategies: `__call__`
  re-packs at a halved token budget (`laden sft`), `split_documents` makes the same packed
  micro-batches again split at document boundaries (`laden rl`). A training step that runs out of
  memory is retried with the same samples (`oom_policy: auto`), so no sample is dropped and the
  retried step equals one that used the smaller budget from the start; at one longest sequence per
  micro-batch the last retry turns on layer recompute (`recompute`). Under torchrun the
  ranks agree before the step's collectives: every rank packs and places its micro-batches,
  then all ranks exchange whether that worked (one all-reduce on a gloo group), and all retry
  together. An out-of-memory error inside an engine's collective part of the step cannot be
  retried in the process (the other ranks wait inside a collective that the failed rank will
  not join again): it is reported with the knob changes on the failing rank, that process
  exits, torchrun stops the others, and a rerun resumes from the newest checkpoint.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from laden.config import ConfigError, LadenConfig, validate_against_model
from laden.engine.backend import TrainBackend
from laden.engine.device import default_device
from laden.engine.factory import launched_world_size
from laden.engine.oom import TrainingOOMError, is_host_oom, is_oom, release_cached_memory

log = logging.getLogger("laden.runtime")
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class Runtime:
    """Where this process runs: its rank under torchrun (0 of 1 otherwise) and its device."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    device: torch.device
    """This process's device."""
    host_group: Any = field(default=None)
    """A gloo group over every rank for host-side agreement (None in one process)."""
    backend: Any = field(default=None)
    """The training engine's backend object (`laden.engine.backend.TrainBackend`) of a trainer's run."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=self.host_group)

    def on_main(self, fn: Callable[[], T]) -> T | None:
        """Run `fn` on rank 0; an error it raises is raised on every rank (same type and message)."""
        error: BaseException | None = None
        result = None
        if self.is_main:
            try:
                result = fn()
            except (ValueError, OSError, RuntimeError) as exc:
                error = exc
        if self.world_size > 1:
            box = [None if error is None else (type(error).__name__, str(error))]
            torch.distributed.broadcast_object_list(box, src=0, group=self.host_group)
            if box[0] is not None and error is None:
                name, message = box[0]
                error = RuntimeError(message) if name == "RuntimeError" else ValueError(message)
        if error is not None:
            raise error
        return result

    def gather_floats(self, value: float) -> list[float]:
        """`value` of every rank, in rank order (one all-gather on the host group; every rank calls it)."""
        if self.world_size == 1:
            return [value]
        mine = torch.tensor([value], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(every, mine, group=self.host_group)
        return [float(t.item()) for t in every]

    def share(self, value: T) -> T:
        """Rank 0's `value` on every rank (one broadcast of a picklable object on the host group)."""
        if self.world_size == 1:
            return value
        box = [value if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]  # type: ignore[return-value]

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (one all-reduce on the host group; every rank calls it)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int64)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=self.host_group)
        return bool(value.item())  # a host tensor: no device sync


def seed_everything(seed: int) -> None:
    """Python's, NumPy's and torch's generators from the run's `seed`."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_runtime(backend: TrainBackend | None = None, *, cpu: bool = False) -> Runtime:
    """Join torchrun's process group when launched by it; otherwise a single process. `backend`: the
    engine's backend object the trainer asks (`Runtime.backend`); `cpu`: on the CPU (gloo) even where
    CUDA is visible (`cluster.n_gpus_per_node: 0`)."""
    if launched_world_size() == 1:
        return Runtime(
            rank=0, world_size=1, device=torch.device("cpu") if cpu else default_device(), backend=backend
        )
    from laden.engine.parallel.launch import init_distributed

    rank, world_size, _, device = init_distributed("gloo" if cpu else None)
    host_group = torch.distributed.new_group(backend="gloo")
    return Runtime(rank=rank, world_size=world_size, device=device, host_group=host_group, backend=backend)


def check_world_size(cfg: LadenConfig, rt: Runtime, job: str, backend: TrainBackend) -> None:
    """`actor.backend` names one process per data/tensor/context rank: the launch must match it."""
    num_procs = backend.num_processes
    if num_procs != rt.world_size:
        fix = (
            f"torchrun --nproc_per_node {num_procs} -m laden.cli {job} ..."
            if num_procs > 1
            else f"plain `laden {job}`"
        )
        raise ValueError(
            f"actor.backend={cfg.actor.backend!r} needs {num_procs} process(es) but {rt.world_size} were "
            f"launched; start it with {fix}, or change actor.backend to match the launch"
        )


# ------------------------------------------------------------------------------ the model


def load_model(cfg: LadenConfig, rt: Runtime, backend: TrainBackend) -> nn.Module:
    """The model this rank hands its engine as `backend` loads it (a meta skeleton on ranks > 0 with
    `actor.fsdp.memory_efficient_load`), with LoRA adapters and the model patches for that engine."""
    model = backend.load_model(cfg, rt)
    check_model(cfg, model)
    adapt_model(cfg, model)
    patch_model(cfg, model, backend)
    return model


def batch_device(backend: TrainBackend, rt: Runtime) -> torch.device:
    """Where the trainer packs its micro-batches: the host for an engine that uploads each micro-batch
    with its stages (`batches_on_host`: roundpipe), this rank's device otherwise."""
    return torch.device("cpu") if backend.batches_on_host else torch.device(rt.device)


def adapt_model(cfg: LadenConfig, model: nn.Module) -> None:
    """`actor.use_lora`: peft's LoRA adapters injected (seeded by `seed`), everything else frozen,
    before the patches (which leave adapted projections alone) and before an engine wraps it."""
    from laden.model.lora import LoraSettings, apply_lora

    settings = LoraSettings.from_actor(cfg.actor)
    if settings is None:
        return
    try:
        num_adapted = apply_lora(model, settings, seed=cfg.seed)
    except ImportError as err:
        raise ImportError(
            f"actor.use_lora=true needs the optional `peft` package ({err}); pip install 'laden[lora]'"
        ) from err
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info(
        "actor.use_lora: %d projections adapted (rank %d, alpha %g), %.2fM of %.1fM parameters trainable",
        num_adapted, settings.rank, settings.alpha, trainable / 1e6, total / 1e6,
    )  # fmt: skip


def check_model(cfg: LadenConfig, model: nn.Module) -> None:
    """The model's head rules for `actor.backend` (checked at config load too, from config.json; here
    again for models that have none, GGUF files). The rollout engine checks its own when it starts."""
    mc: Any = model.config
    num_heads = int(mc.num_attention_heads)
    num_kv_heads = int(getattr(mc, "num_key_value_heads", None) or num_heads)
    errors = validate_against_model(
        cfg, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, rollout=False
    )
    if errors:
        raise ConfigError(errors)


def patch_model(cfg: LadenConfig, model: nn.Module, backend: TrainBackend) -> None:
    """`actor.lean_activations`, `actor.fused_elementwise` and `actor.tiled_mlp_tokens` on this model,
    before an engine wraps it, logged as they apply to the engine that will run it."""
    from laden.model.patches.apply import apply_patches, resolve_fused_elementwise

    actor = cfg.actor
    report = apply_patches(
        model,
        lean_activations=actor.lean_activations,
        fused_elementwise=resolve_fused_elementwise(actor.fused_elementwise, actor.lean_activations),
        tiled_mlp_tokens=actor.tiled_mlp_tokens,
        tensor_parallel=backend.mode.tp > 1,
    )
    for line in report.describe(backend.name):
        log.info("%s", line)


# ------------------------------------------------------------------------- data parallel


def loss_tokens(samples: Sequence[tuple[Sequence[int], Sequence[int]]], indices: Sequence[int]) -> int:
    """Tokens that carry a loss (a label) in these samples: the global normaliser of a step."""
    return sum(sum(samples[i][1][1:]) for i in indices)


def shard_for_rank(samples: Sequence[tuple[Sequence[int], Any]], indices: Sequence[int], dp_rank: int,
                   dp_size: int) -> list[int]:  # fmt: skip
    """This data-parallel rank's share of a global batch, balanced by tokens (longest first, to the lightest rank)."""
    if dp_size == 1:
        return list(indices)
    loads = [0] * dp_size
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(indices, key=lambda i: (-len(samples[i][0]), i)):
        r = min(range(dp_size), key=lambda r: (loads[r], r))
        loads[r] += len(samples[i][0])
        shares[r].append(i)
    return sorted(shares[dp_rank])


# ------------------------------------------------------------------------------ OOM retry


@dataclass(kw_only=True, slots=True)
class OOMRetry:
    """Runs one step's preparation and work, re-splitting on out-of-memory (see the module docstring).

    `prepare(tokens_per_mb)` packs and places this rank's micro-batches (no collectives);
    `run(prepared)` is the engine's part of the step. Under `oom_policy: raise`, or once the
    budget cannot shrink (the longest sequence alone), the error is raised with the knob changes.
    """

    cfg: LadenConfig
    """The run's config (`oom_policy`, and the knobs the advice names)."""
    rt: Runtime
    """This process; under torchrun the ranks agree on every retry."""
    recompute: Callable[[], bool] | None = None
    """Turns on layer recompute in the engine (True if it was off): the last retry, once the token budget
    cannot shrink (one process only; `enable_recompute` of the fsdp engine)."""

    def __call__(
        self,
        prepare: Callable[[int], T],
        run: Callable[[T], Any],
        *,
        step: int,
        tokens_per_mb: int,
        longest: int,
    ) -> tuple[Any, T]:
        while True:
            failure: BaseException | None = None
            prepared: T | None = None
            try:
                prepared = prepare(tokens_per_mb)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                failure = exc
            if self.rt.any_rank(failure is not None):  # every rank: the ranks retry together or not at all
                prepared = None
                release_cached_memory()
                tokens_per_mb = self._smaller(tokens_per_mb, longest, step, failure)
                continue
            assert prepared is not None
            try:
                return run(prepared), prepared
            except Exception as exc:
                if not is_oom(exc):
                    raise
                prepared = None
                release_cached_memory()
                if self.rt.world_size > 1:  # the other ranks are inside the step's collectives
                    raise self._error(step, tokens_per_mb, longest, exc, in_collectives=True) from exc
                tokens_per_mb = self._smaller(tokens_per_mb, longest, step, exc)

    def split_documents(
        self, mbs: list[Any], run: Callable[[list[Any]], T], *, step: int, on_failure: Callable[[], None]
    ) -> T:
        """`run(mbs)` on packed micro-batches; on out-of-memory in one process under `oom_policy: auto`,
        again on the same documents with each micro-batch split in two at a document boundary
        (`laden.data.batch.split_documents`), as often as it takes, then with layer recompute
        (`recompute`). `on_failure` drops what the failed attempt left (its partial statistics).
        Otherwise, or with nothing left to split, the error names the knob changes."""
        from laden.data.batch import split_documents

        while True:
            try:
                return run(mbs)
            except Exception as exc:
                if not is_oom(exc):
                    raise
                release_cached_memory()
                on_failure()
                tokens = max(mb.num_tokens for mb in mbs)
                if self.cfg.oom_policy == "auto" and self.rt.world_size == 1:
                    split = [part for mb in mbs for part in split_documents(mb)]
                    if len(split) > len(mbs):
                        log.warning("step %d ran out of memory at %d tokens per micro-batch; retrying the same "
                                    "documents in %d micro-batches", step, tokens, len(split))  # fmt: skip
                        mbs = split
                        continue
                longest = max(max(mb.seqlens, default=0) for mb in mbs)
                if not self._recomputes(step, exc, tokens, at_the_end=True):
                    raise self._error(
                        step, tokens, longest, exc, in_collectives=self.rt.world_size > 1
                    ) from exc

    def _recomputes(
        self, step: int, exc: BaseException | None, tokens_per_mb: int, *, at_the_end: bool
    ) -> bool:
        """The last resort, once micro-batches cannot shrink (`at_the_end`): layer recompute turned on in the
        engine for this and every later step (one process, `oom_policy: auto`); whether it was."""
        if not (at_the_end and exc is not None and self.cfg.oom_policy == "auto" and self.rt.world_size == 1):
            return False
        if self.recompute is None or not self.recompute():
            return False
        log.warning(
            "step %d ran out of memory at one sequence per micro-batch (%d tokens); retrying with layer "
            "recompute (actor.gradient_checkpointing on from now)", step, tokens_per_mb,
        )  # fmt: skip
        return True

    def _smaller(self, tokens_per_mb: int, longest: int, step: int, exc: BaseException | None) -> int:
        """The halved budget for the retry, or the error when there is none."""
        if self._recomputes(step, exc, tokens_per_mb, at_the_end=tokens_per_mb <= longest):
            return tokens_per_mb
        if self.cfg.oom_policy != "auto" or tokens_per_mb <= longest:
            if exc is None:  # another rank failed; it raises the full report
                raise RuntimeError(
                    f"training step {step}: another rank ran out of memory and cannot retry (oom_policy="
                    f"{self.cfg.oom_policy}, {tokens_per_mb} tokens per micro-batch); see that rank's error"
                )
            raise self._error(step, tokens_per_mb, longest, exc) from exc
        smaller = max(longest, tokens_per_mb // 2)
        who = "" if exc is not None else " (on another rank)"
        log.warning(
            "step %d ran out of memory%s; retrying with %d tokens per micro-batch", step, who, smaller
        )
        return smaller

    def _error(self, step: int, tokens_per_mb: int, longest: int, exc: BaseException, *,
               in_collectives: bool = False) -> TrainingOOMError:  # fmt: skip
        fixes = self.rt.backend.training_oom_fixes(
            self.cfg, host=is_host_oom(exc), tokens_per_mb=tokens_per_mb, longest_seq=longest
        )
        return TrainingOOMError(step=step, cause=exc, fixes=fixes, in_collectives=in_collectives)
