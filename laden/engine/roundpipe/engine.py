"""`RoundPipeEngine`: the config-driven roundpipe backend (`actor.backend: roundpipe:...`).

It implements `laden.engine.base.TrainEngine` over the same pipeline as the library API,
with the optimizer driven internally, parameter group by parameter group, as soon as a
group's gradient is complete:

- the gradient norm is summed group by group on the landing thread while the device still
  runs the backward of earlier layers (and, data parallel, each group is all-reduced there,
  in a fixed order so every replica issues the same collectives);
- without gradient clipping each group's update starts right away on the optimizer thread,
  during `forward_backward`, overlapping the rest of the backward; with clipping the updates
  wait for the global norm, which `optimizer_step` applies, and then run in forward order, so
  the next step's first stages can start uploading as soon as their own weights are updated
  (per-group generation counters). `optimizer_step` also advances the LR schedule and
  `version`; a step that `forward_backward` began must be finished by it before anything
  else runs (the weights are half updated until then);
- fp32 masters with bf16 compute: the update writes the bf16 upload copy in the same pass
  (`updates.update_group`), so there is no separate cast pass; `adam_bf16` (and fp32 masters
  with fp32 compute): the master *is* the upload copy, the Kahan update writes in place what
  the next residency uploads (no copy at all). The optimizer comes from the one builder,
  `laden.optim.build_optimizer(..., where="host")`, so a config gives the same optimizer and
  warnings here as under every engine (`adam` on bf16 masters: `torch.optim.AdamW`, warned).

The head step hands the final hidden states, the head weight and the micro-batch on the
device (labels and per-token `fields`) to the objective (`head_loss`): the constructor's
`CrossEntropy` by default, any `Objective` per call. `forward` runs the same pipeline without
gradients and returns the per-token log-probs and entropies of each micro-batch.

`optim_step="sync"` is exact: step k+1 reads the weights of update k (it waits per group).
`optim_step="async"` is one-step stale: step k+1 reads the upload buffer holding the
weights of update k-1 while update k writes the other one, so the whole optimizer step
hides behind the next step's compute; it costs a second upload buffer and a second
gradient inbox in host memory (and, for masters shared with the upload copy, one buffer
copy per update). Host bytes per parameter of every mode: `host.memory`; what an engine
holds: `host_bytes_by_kind()`. Weights, checkpoints and exports read the masters, which
always hold the newest weights (`host.hf_state`); `named_weights` in the compute dtype reads
the upload buffer the last update wrote instead (the masters rounded, bit for bit, and
page-locked: a colocated weight update is then a pinned host-to-device copy).

A model with its parameters on the meta device (`host.memory.meta_params`) is materialised
layer by layer into the host store and filled by `init_meta` (default: a Hugging Face
model's `_init_weights`), so building a large model never needs a second copy of it.

Each `PackedBatch` is one micro-batch (a packed row `[1, T]`); `num_microbatch` is the
planner's hint to the trainer for how many rows to pack per step.

Without an explicit `execute_plan` the stages are planned by `ModelExecutePlan.auto` for
`max_tokens_per_mb` tokens per micro-batch (weights and activations); a step whose longest
micro-batch is longer than planned for is re-planned first (deterministically, from sizes).

The update jobs, the head's loss functions and the Hugging Face view of the host store live
in `updates`, `head_loss` and `host.hf_state`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from laden.data.batch import PackedBatch
from laden.engine.base import FORWARD_OUTPUTS, ForwardOutput, Objective, OffloadedError, TrainEngineBase
from laden.engine.roundpipe.call import Run
from laden.engine.roundpipe.device import default_devices
from laden.engine.roundpipe.distributed import host_grad_group
from laden.engine.roundpipe.head_loss import ObjectiveLoss, TokenOutputsLoss, batch_tree, packed_kwargs
from laden.engine.roundpipe.host import hf_state
from laden.engine.roundpipe.host.store import ParamGroup, PinMode
from laden.engine.roundpipe.pipeline import Pipeline, sum_losses
from laden.engine.roundpipe.plan import ModelExecutePlan
from laden.engine.roundpipe.step_grads import StepGrads
from laden.engine.roundpipe.updates import clip_coef, scheduler_step, update_group
from laden.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from laden.model.objective import CrossEntropy
from laden.model.split import split_causal_lm
from laden.optim import OptimSettings, build_optimizer, is_no_decay, load_named_state, named_state

OptimStep = Literal["sync", "async"]


@dataclass(slots=True)
class _PendingStep:
    """A `forward_backward` whose `optimizer_step` has not run yet: its gradients and inbox."""

    grads: StepGrads
    buf: int


class RoundPipeEngine(TrainEngineBase):
    """A causal LM in host memory, trained by streaming stages through the device pool."""

    collective_export = False
    """Replicas hold the same weights, so replica 0 alone reads them for an export."""

    def __init__(
        self,
        model: nn.Module,
        *,
        optim: OptimSettings,
        compute_dtype: torch.dtype = torch.bfloat16,
        optimizer_dtype: torch.dtype = torch.float32,
        num_microbatch: int | None = None,
        recompute_grain: Literal["stage", "layer"] = "stage",
        model_memory_limit: float | None = None,
        pin_model: PinMode = "alloc",
        optim_step: OptimStep = "sync",
        devices: Sequence[torch.device] | None = None,
        loss_chunk_size: int | None = None,
        objective: Objective | None = None,
        process_group: Any = None,
        execute_plan: ModelExecutePlan | None = None,
        min_stages: int | None = None,
        max_tokens_per_mb: int | None = None,
        init_meta: Callable[[nn.Module], None] | None = None,
        compile_backend: str | None = None,
    ) -> None:
        """`objective`: the default of `train_batch` / `eval_batch` (default: chunked `CrossEntropy`
        of `loss_chunk_size` tokens); `loss_chunk_size`: the token chunk of `forward`'s outputs
        (default: the objective's chunk size) and of the planner's activation estimate."""
        _check_choices(optim_step, recompute_grain, loss_chunk_size)
        self.objective, self.loss_chunk_size = _objective_and_chunk(objective, loss_chunk_size)
        self.model = model.train()
        self.compute_dtype = compute_dtype
        self.optim_settings = optim
        self.num_microbatch = num_microbatch
        self.recompute_grain = recompute_grain
        self.optim_step = optim_step
        if compile_backend is not None:  # actor.roundpipe.compile
            from laden.model.patches.compiled import enable_compiled_layers

            enable_compiled_layers(model, backend=compile_backend)
        split = split_causal_lm(model)
        names = {id(p): n for n, p in model.named_parameters()}
        self.pipe = Pipeline(
            list(split.layers), param_names=names, devices=devices, pin_model=pin_model,
            compute_dtype=compute_dtype, master_dtype=optim.master_dtype(optimizer_dtype), create_masters=True,
            group_key=is_no_decay, name="roundpipe-engine", init_meta=init_meta or _default_init(model, devices),
            loss_chunk_size=_estimate_chunk(self.objective, self.loss_chunk_size),
        )  # fmt: skip
        self._auto_plan = execute_plan is None
        self._plan_limits = (model_memory_limit, min_stages)
        self._planned_tokens = max_tokens_per_mb
        if execute_plan is None:
            execute_plan = self._make_plan(max_tokens_per_mb)
        execute_plan.check_valid(self.pipe.num_layers, "fused")
        self.plan = execute_plan
        self.optimizer = _build_optimizer(self.pipe, optim)
        self.scheduler = optim.build_scheduler(self.optimizer)
        self.process_group = host_grad_group(process_group)
        self.preserve_rng = _has_dropout(model)  # recompute must replay dropout masks
        self._version = 0
        self._pending: _PendingStep | None = None
        self._offloaded = False
        if optim_step == "async":
            self.pipe.store.add_upload_buffer()
            self.pipe.store.ensure_inboxes(2)

    # ---- plan -------------------------------------------------------------------------
    def _make_plan(self, num_tokens: int | None) -> ModelExecutePlan:
        limit, min_stages = self._plan_limits
        return ModelExecutePlan.auto(
            "fused", self.pipe, model_memory_limit=limit, min_stages=min_stages,
            tokens_per_microbatch=num_tokens, recompute_grain=self.recompute_grain,
        )  # fmt: skip

    def _fit_plan(self, micro_batches: Sequence[PackedBatch]) -> None:
        """Re-plan an automatic plan for micro-batches longer than it was planned for."""
        if not self._auto_plan or not micro_batches:
            return
        longest = max(mb.num_tokens for mb in micro_batches)
        if self._planned_tokens is None or longest > self._planned_tokens:
            self.plan = self._make_plan(longest)
            self._planned_tokens = longest

    # ---- training -------------------------------------------------------------------------
    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, *, normalizer: float
    ) -> torch.Tensor:
        """Gradients of `sum(objective(mb)) / normalizer` into the host inboxes (see `TrainEngine`).

        Without gradient clipping, the updates of groups whose gradients are complete start
        during the call; `optimizer_step` must follow before any other call.
        """
        self._check_ready("forward_backward")
        _check_step_args(micro_batches, normalizer)
        self._fit_plan(micro_batches)
        pipe = self.pipe
        buf = pipe.read_buf
        clipping = self.optim_settings.gradient_clipping > 0
        # A tied weight's gradient stays on the device between its stages; the automatic plan
        # leaves room for it (a given plan keeps the host path: its stages were sized without it).
        carried = pipe.carried_params(self.plan) if self._auto_plan else frozenset()
        grads = StepGrads(
            pipe, self.plan, buf, process_group=self.process_group,
            update=None if clipping else (lambda g: self._submit_update(g, buf, 1.0)), carried=carried,
        )  # fmt: skip
        try:
            run = pipe.run_call(
                inputs=_inputs(micro_batches), labels=[batch_tree(mb) for mb in micro_batches],
                loss_fn=ObjectiveLoss(objective, normalizer), plan=self.plan, grain=self.recompute_grain,
                backward=True, preserve_rng=self.preserve_rng, on_landing=grads.on_landing, carried=carried,
            )  # fmt: skip
        except BaseException as error:
            self._abandon_step(grads, buf, error)
            raise
        grads.check_complete()
        pipe.store.mark_pending(pipe.trainable_groups(), buf)
        self._pending = _PendingStep(grads, buf)
        return self._global_loss(sum_losses(run))

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Clip with the global norm, queue the remaining updates and the LR step; `version` += 1.

        Returns `grad_norm` (before clipping, a host tensor) and `lr` (this step's). The updates
        run on the host optimizer thread; the next call waits for the weights it reads.
        """
        self._check_ready("optimizer_step")
        step = self._pending
        if step is None:
            raise RuntimeError(
                "optimizer_step() called without a forward_backward() before it; nothing to apply"
            )
        self._pending = None
        norm = step.grads.norm()
        max_norm = self.optim_settings.gradient_clipping
        coef = clip_coef(norm, max_norm) if max_norm > 0 else 1.0
        for group in step.grads.pending_updates():  # forward order: the next step's first stages first
            self._submit_update(group, step.buf, coef)
        lr = self._scheduled_lrs()[0]
        self.pipe.jobs.submit_optim(scheduler_step, self.scheduler)
        self._version += 1
        if self.optim_step == "async":
            self.pipe.read_buf = 1 - step.buf
        return {"grad_norm": norm, "lr": torch.tensor(lr)}

    def _eval_loss(
        self, micro_batches: Sequence[PackedBatch], objective: Objective, normalizer: float
    ) -> torch.Tensor:
        self._check_ready("eval_batch")
        _check_step_args(micro_batches, normalizer)
        loss_fn = ObjectiveLoss(objective, normalizer)
        return self._global_loss(sum_losses(self._run_without_grad(micro_batches, loss_fn)))

    def _writes_export(self) -> bool:
        return self.dp_rank == 0

    def enable_recompute(self) -> bool:
        """False: every backward stage is recomputed from its saved input already (`recompute_grain`)."""
        return False

    @torch.no_grad()
    def forward(
        self,
        micro_batches: Sequence[PackedBatch],
        *,
        outputs: Sequence[ForwardOutput] = FORWARD_OUTPUTS,
        temperature: float = 1.0,
    ) -> list[dict[str, torch.Tensor]]:
        """Per micro-batch, each requested output as a `[T]` fp32 host tensor (see `TrainEngine`).

        Runs on the weights the next step would read: after an asynchronous step, those of one
        update earlier. Dropout is off.
        """
        self._check_ready("forward")
        head = TokenOutputsLoss(outputs, temperature=temperature, chunk_size=self.loss_chunk_size)
        if not micro_batches or not head.outputs:
            return [{} for _ in micro_batches]
        run = self._run_without_grad(micro_batches, head)
        return [dict(zip(head.outputs, _parked(h))) for h in run.losses]

    def _run_without_grad(self, micro_batches: Sequence[PackedBatch], loss_fn: Callable[..., Any]) -> Run:
        self._fit_plan(micro_batches)
        self.model.eval()  # shells copy the mode: no dropout
        try:
            return self.pipe.run_call(
                inputs=_inputs(micro_batches), labels=[batch_tree(mb) for mb in micro_batches],
                loss_fn=loss_fn, plan=self.plan, grain=self.recompute_grain, backward=False, preserve_rng=False,
            )  # fmt: skip
        finally:
            self.model.train()

    def _check_ready(self, what: str, *, offloaded_ok: bool = False) -> None:
        """Refuse a call while offloaded, or between `forward_backward` and `optimizer_step`."""
        if self._offloaded and not offloaded_ok:
            raise OffloadedError(what)
        if self._pending is not None and what != "optimizer_step":
            raise RuntimeError(
                f"{what} called between forward_backward and optimizer_step: that step's gradients are "
                "pending and its parameter updates may have begun; call engine.optimizer_step() first"
            )

    # ---- weights, memory, state -------------------------------------------------------------
    def named_weights(
        self,
        dtype: torch.dtype | None = None,
        *,
        device: torch.device | str | None = None,
        trained_only: bool = False,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's Hugging Face state (`hf_state_names`), one tensor at a time, from the masters; a
        LoRA model's merged (`laden.model.lora.merged_weights`; `trained_only`: its adapted projections).

        `dtype`: floating tensors' dtype (default: the compute dtype); `device`: default the host.
        Drains the host jobs first, so the weights are those of every step applied; works while
        offloaded. A tensor is the live master when nothing needs converting, and in the compute
        dtype the current upload copy (`_newest_upload_buf`; page-locked with `pin_model` alloc
        or register): the engine's own storage, to read, not to modify; copy it to keep it.
        """
        self._check_ready("named_weights", offloaded_ok=True)
        self.pipe.jobs.drain()
        return hf_state.named_weights(
            self.pipe.store,
            self.model,
            dtype or self.compute_dtype,
            device,
            upload_buf=self._newest_upload_buf(),
            trained_only=trained_only,
        )

    def _newest_upload_buf(self) -> int:
        """The upload buffer that holds the newest weights once the host jobs are drained.

        Every update of a step writes the upload buffer that step read (`update_group`), and
        every trainable group is updated each step. Synchronous step: always buffer 0. The
        asynchronous step flips `read_buf` after queuing the updates, so the buffer the last
        update wrote is `1 - read_buf`; the other one, which the next step reads, holds the
        weights of one update earlier. Before the first step both buffers are copies of the
        same weights (`add_upload_buffer`), and `load_state_dict` rewrites both, so the rule
        holds then too. Between `forward_backward` and `optimizer_step` no buffer is current
        (updates may be half done): `named_weights` is refused then.
        """
        read_buf = self.pipe.read_buf
        return 1 - read_buf if self.optim_step == "async" else read_buf

    def offload(self) -> None:
        """Release what the engine holds for its next step beside the host state; idempotent.

        Waits for the host jobs (updates, landings) and the devices, then frees: on a GPU, the
        device memory torch's caching allocator keeps from the last call (every stage's weights,
        gradient accumulators, activations and a tied weight's carried gradient are freed when
        their residency or call ends, but stay reserved; compiled kernels' caches aside); on
        every machine, the pooled host buffers of parked activations (page-locked on a GPU
        machine). Weights, masters, gradients and optimizer states are host state and stay.
        Until `onload`, a step (`forward_backward`, `optimizer_step`, `train_batch`,
        `eval_batch`, `forward`) raises `OffloadedError`; `named_weights` and checkpoints work.
        """
        if self._offloaded:
            return
        self.pipe.release_device_memory()
        self._offloaded = True

    def onload(self) -> None:
        """Allow steps again; the next call re-allocates what it needs as it goes (idempotent)."""
        self._offloaded = False

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    @property
    def version(self) -> int:
        """Optimizer steps applied (queued: the updates finish on the host optimizer thread)."""
        return self._version

    def state_dict(self) -> dict[str, Any]:
        """The shared checkpoint layout over the live host tensors (masters, optimizer states)."""
        self._check_ready("state_dict", offloaded_ok=True)
        self.pipe.jobs.drain()
        return {
            "model": hf_state.model_state(self.pipe.store, self.model),
            "optimizer": named_state(self.optimizer, self._master_names()),
            "scheduler": self.scheduler.state_dict(),
            "version": self._version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the shared layout (plain tensors or DTensors) and rewrite every upload buffer."""
        self._check_ready("load_state_dict", offloaded_ok=True)
        self.pipe.jobs.drain()
        store = self.pipe.store
        hf_state.load_model_state(store, self.model, state["model"])
        for buf in range(store.num_upload_buffers):
            self.pipe.refresh_uploads(store.groups, buf)
        load_named_state(self.optimizer, self._master_names(), state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._version = int(state["version"])
        # The next update applies the schedule's LR at `version` (what `optimizer_step` reports),
        # whatever LR the loaded param groups carried.
        for group, lr in zip(self.optimizer.param_groups, self._scheduled_lrs()):
            group["lr"] = lr

    def _scheduled_lrs(self) -> list[float]:
        """Each param group's LR of step `version` under the schedule."""
        scheduler = self.scheduler
        return [float(base) * fn(self._version) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]

    def _master_names(self) -> dict[int, str]:
        return {id(hp.master): hp.name for hp in self.pipe.store.params if hp.master is not None}

    def _global_loss(self, loss: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Each replica's loss is its share of the global mean: sum them over the replicas."""
        assert isinstance(loss, torch.Tensor), "the engine's loss function returns one tensor"
        if self.process_group is None:
            return loss
        # Deliberate sync: the host-gradient group is gloo, so the scalar goes through the host.
        total = loss.detach().float().cpu().clone()
        torch.distributed.all_reduce(total, group=self.process_group)
        return total

    @property
    def dp_rank(self) -> int:
        """This replica's index: the trainer gives it its share of each global batch."""
        return 0 if self.process_group is None else torch.distributed.get_rank(self.process_group)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas whose host gradients are summed."""
        return 1 if self.process_group is None else torch.distributed.get_world_size(self.process_group)

    @property
    def num_params(self) -> int:
        return sum(hp.numel for hp in self.pipe.store.params)

    def host_bytes_by_kind(self) -> dict[str, int]:
        """Host bytes of the model state as allocated now, by kind (see `host.memory.HOST_KINDS`).

        Optimizer states appear after the first update; drains the host jobs first.
        """
        from laden.engine.roundpipe.host.memory import measured_host_bytes

        self.pipe.jobs.drain()
        return measured_host_bytes(self.pipe.store, self.optimizer)

    def _abandon_step(self, grads: StepGrads, buf: int, error: BaseException) -> None:
        """A failed step (e.g. out of memory) leaves no gradients behind, so a retry is exact."""
        for lane in self.pipe.lanes:
            lane.synchronize()  # deliberate: let queued copies finish before the buffers are reused
        with contextlib.suppress(RuntimeError):  # a failed landing is re-raised by the next call
            self.pipe.jobs.drain_landing()
        for hp in self.pipe.store.params:
            hp.filled[buf] = False
        if grads.updated:
            raise RuntimeError(
                f"the step failed after {len(grads.updated)} parameter groups were already updated "
                "(early per-group updates run when gradient clipping is off), so it cannot be retried "
                "exactly; set actor.optimizer.gradient_clipping > 0 to update only complete steps"
            ) from error

    def _submit_update(self, group: ParamGroup, buf: int, coef: float) -> None:
        self.pipe.jobs.submit_optim(update_group, self.pipe.store, self.optimizer, group, buf, coef)


def _check_choices(optim_step: str, recompute_grain: str, loss_chunk_size: int | None) -> None:
    if optim_step not in ("sync", "async"):
        raise ValueError(f"actor.roundpipe.optim_step={optim_step!r} must be 'sync' or 'async'")
    if recompute_grain not in ("stage", "layer"):
        raise ValueError(f"actor.roundpipe.recompute_grain={recompute_grain!r} must be 'stage' or 'layer'")
    if loss_chunk_size is not None and loss_chunk_size < 1:
        raise ValueError(f"actor.loss_chunk_size={loss_chunk_size} must be >= 1 token, e.g. 1024")


def _check_step_args(micro_batches: Sequence[PackedBatch], normalizer: float) -> None:
    if not micro_batches:
        raise ValueError("got no micro-batches; pass this rank's packed micro-batches of the step")
    if not normalizer > 0:
        raise ValueError(f"normalizer={normalizer} must be > 0, e.g. the global batch's loss-token count")


def _inputs(micro_batches: Sequence[PackedBatch]) -> list[tuple[tuple, dict[str, Any]]]:
    return [((), packed_kwargs(mb)) for mb in micro_batches]


def _parked(handoff: Any) -> list[torch.Tensor]:
    """A micro-batch's parked head outputs (host tensors: the call synchronised)."""
    assert handoff is not None, "every micro-batch of a call parks its head outputs"
    return handoff.host_tree()


def _objective_and_chunk(objective: Objective | None, loss_chunk_size: int | None) -> tuple[Objective, int]:
    """The default objective (chunked cross-entropy) and the chunk of `forward`'s outputs."""
    if objective is None:
        objective = CrossEntropy(chunk_size=loss_chunk_size or DEFAULT_LOSS_CHUNK_SIZE)  # validated >= 1
    if loss_chunk_size is None:
        loss_chunk_size = getattr(objective, "chunk_size", DEFAULT_LOSS_CHUNK_SIZE)
    return objective, loss_chunk_size


def _estimate_chunk(objective: Objective, loss_chunk_size: int) -> int:
    """The token chunk the planner counts the head's logits for: every token for full-logit cross-entropy."""
    if isinstance(objective, CrossEntropy) and not objective.chunked:
        return sys.maxsize
    return loss_chunk_size


def _build_optimizer(pipe: Pipeline, settings: OptimSettings) -> torch.optim.Optimizer:
    """The one builder over the masters by name (it groups biases and 1-D params without decay)."""
    masters = [(hp.name, hp.master) for hp in pipe.store.params if hp.master is not None]
    # Leave four cores: the thread feeding the GPU, autograd's device thread, gradient landings, uploads.
    on_gpu = any(lane.is_cuda for lane in pipe.lanes)
    threads = max(1, torch.get_num_threads() - 4) if on_gpu else None
    return build_optimizer(masters, settings, where="host", num_threads=threads)


def _has_dropout(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    if any(getattr(config, name, 0.0) for name in ("attention_dropout", "hidden_dropout", "dropout")):
        return True
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def _default_init(
    model: nn.Module, devices: Sequence[torch.device] | None
) -> Callable[[nn.Module], None] | None:
    """For parameters on the meta device: a Hugging Face model's own per-module initialisation.

    With a GPU, each module's parameters are initialised there and copied into the host store:
    random fills on the CPU run on one core (about 5 ns per parameter, 40 s for an 8B model),
    on the GPU they are free and the copy runs at transfer speed.
    """
    if not any(p.is_meta for p in model.parameters()):
        return None
    init = getattr(model, "_init_weights", None)
    if init is None:
        return None
    device = next((d for d in devices or default_devices() if torch.device(d).type == "cuda"), None)
    return init if device is None else functools.partial(_init_on_device, init, torch.device(device))


@torch.no_grad()
def _init_on_device(init: Callable[[nn.Module], None], device: torch.device, module: nn.Module) -> None:
    """`init(module)` on device twins of the module's own parameters, copied back into them."""
    originals = {name: p for name, p in module._parameters.items() if p is not None}
    try:
        for name, p in originals.items():
            module._parameters[name] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
            )
        init(module)
        for name, p in originals.items():
            p.copy_(module._parameters[name])  # type: ignore[arg-type]
    finally:
        module._parameters.update(originals)


def build_roundpipe_engine(
    cfg: Any, model: nn.Module, *, mode: Any, optim: OptimSettings, device: Any
) -> RoundPipeEngine:
    """Map `actor.*` and `actor.roundpipe.*` onto a `RoundPipeEngine` (called by the engine factory).

    Devices: the CPU when `device` is the CPU; one process per node (the `roundpipe:dN` layout:
    N data-parallel replicas) pools every visible GPU; several processes per node each keep
    to their own `device`. `actor.chunked_loss` and `actor.loss_chunk_size` make the default
    objective; `actor.gradient_checkpointing` is ignored with a warning (see `_warn_ignored`).
    """
    from laden.model.dtypes import torch_dtype

    actor, rp = cfg.actor, cfg.actor.roundpipe
    _warn_ignored(actor)
    devices = None
    if device is not None and torch.device(device).type == "cpu":
        devices = [torch.device("cpu")]
    elif device is not None and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        devices = [torch.device(device)]
    return RoundPipeEngine(
        model, optim=optim, compute_dtype=torch_dtype(actor.dtype), optimizer_dtype=torch_dtype(actor.optimizer_dtype),
        num_microbatch=rp.num_microbatch, recompute_grain=rp.recompute_grain,
        model_memory_limit=rp.model_memory_limit, pin_model=rp.pin_model, optim_step=rp.optim_step,
        devices=devices, loss_chunk_size=actor.loss_chunk_size,
        objective=CrossEntropy(chunked=actor.chunked_loss, chunk_size=actor.loss_chunk_size),
        max_tokens_per_mb=actor.mb_spec.max_tokens_per_mb, compile_backend="inductor" if rp.compile else None,
    )  # fmt: skip


GRADIENT_CHECKPOINTING_IGNORED = (
    "actor.gradient_checkpointing=true has no effect with actor.backend=roundpipe: the engine recomputes "
    "every backward stage from its saved input by design, at the grain of actor.roundpipe.recompute_grain "
    "(stage: one stage's activations of a micro-batch alive at once; layer: one layer's). For the least "
    "activation memory set actor.roundpipe.recompute_grain=layer; set actor.gradient_checkpointing=false "
    "to silence this"
)


def _warn_ignored(actor: Any) -> None:
    """Warn once per engine about `actor.*` knobs that roundpipe does not use."""
    if actor.gradient_checkpointing:
        warnings.warn(GRADIENT_CHECKPOINTING_IGNORED, UserWarning, stacklevel=3)
